"""Request-level metrics on ``/metrics``: counted and observed from each request's
``ReqState`` as its rows arrive and when it finishes (docs/design.md section 7)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from pipeline.io_struct import CONSTRAINT_KINDS, FinishAbort
from tokenizer_proc.metric_buckets import (
    E2E_BUCKETS,
    GRAMMAR_WAIT_BUCKETS,
    ITL_BUCKETS,
    QUEUE_BUCKETS,
    REJECTION_REASONS,
    RETRACTION_BUCKETS,
    TOKEN_COUNT_BUCKETS,
    TOOL_FINISH_REASONS,
    TTFT_BUCKETS,
)
from tokenizer_proc.metrics_compat import ABSENT, Absent, Naming, one_child
from tokenizer_proc.request_edge.meta_info import time_per_output_token
from tokenizer_proc.peer_buckets import VLLM_FINISH_REASONS
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.tally_histogram import TallyHistogram


class RequestMetrics:
    """Request-level metrics of docs/design.md section 7. Every value comes from the ReqState:
    its ``request_stats`` (the scheduler's numbers) and its own timing."""

    observes_tokens = True

    def __init__(self, naming: Naming) -> None:
        # Registered in this order, which is the order /metrics lists them in.
        self._init_counts(naming)
        self._init_latencies(naming)
        self._init_sizes(naming)
        self._init_structured_output(naming)
        self.peers = RequestPeerSeries(naming)

    def _init_counts(self, naming: Naming) -> None:
        self.prompt_tokens = naming.counter(
            "prompt_tokens", "Prompt tokens of finished requests."
        )()
        self.generation_tokens = naming.counter(
            "generation_tokens", "Generated tokens of finished requests."
        )()
        cached = naming.counter(
            "cached_tokens",
            "Prompt tokens served from the prefix cache, by tier.",
            ("cache_source",),
        )
        self.cached_tokens = {src: cached(src) for src in ("device", "host", "storage", "total")}
        requests = naming.counter("num_requests", "Finished requests.", ("is_streaming",))
        self.num_requests = {s: requests(str(s).lower()) for s in (True, False)}
        self.num_aborted = naming.counter(
            "num_aborted_requests", "Requests that finished by abort."
        )()
        # Refused before they ran: body_too_large (413), queue_full (503), read_timeout.
        rejected = naming.counter(
            "num_rejected_requests", "Requests refused by a limit, by reason.", ("reason",)
        )
        self.num_rejected = {r: rejected(r) for r in REJECTION_REASONS}
        # "asgi" is the slow path: every event through an ASGI send, a task switch per frame.
        # Apart from a client gone just as its stream started, it means uvicorn's own send went
        # unrecognized (pipeline/http/uvicorn_internals.py): an upgrade changed its internals.
        streams = naming.counter(
            "sse_streams",
            "Streamed responses, by how their events reach the client's socket.",
            ("write_path",),
        )
        self.sse_streams = {p: streams(p) for p in ("direct", "asgi")}

    def _init_latencies(self, naming: Naming) -> None:
        ttft = naming.histogram(
            "time_to_first_token_seconds",
            "Arrival to the first token at the API.",
            TTFT_BUCKETS,
            Histogram,
            ("is_streaming",),
        )
        self.ttft = {s: ttft(str(s).lower()) for s in (True, False)}
        self.itl = naming.histogram(
            "inter_token_latency_seconds",
            "Time between tokens as the API sees them, per token.",
            ITL_BUCKETS,
            TallyHistogram,
        )()
        # This frame's per-token gaps, and how many tokens had each.
        self._itl_tally: dict[float, int] = {}
        e2e = naming.histogram(
            "e2e_request_latency_seconds",
            "Arrival to finish.",
            E2E_BUCKETS,
            Histogram,
            ("is_streaming",),
        )
        self.e2e = {s: e2e(str(s).lower()) for s in (True, False)}
        self.tpot = naming.histogram(
            "request_time_per_output_token_seconds",
            "Decode time per output token after the first.",
            ITL_BUCKETS,
            Histogram,
        )()
        self.queue_time = naming.histogram(
            "queue_time_seconds",
            "Time in the scheduler's waiting queue, all stays.",
            QUEUE_BUCKETS,
            Histogram,
        )()

    def _init_sizes(self, naming: Naming) -> None:
        self.num_retractions = naming.histogram(
            "num_retractions", "Retractions per finished request.", RETRACTION_BUCKETS, Histogram
        )()
        self.prompt_tokens_hist = naming.histogram(
            "prompt_tokens_histogram", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS, Histogram
        )()
        self.generation_tokens_hist = naming.histogram(
            "generation_tokens_histogram",
            "Generated tokens per request.",
            TOKEN_COUNT_BUCKETS,
            Histogram,
        )()

    def _init_structured_output(self, naming: Naming) -> None:
        # A chat choice whose request gave tools, by how it finished: tool_calls when it called.
        tools = naming.counter(
            "tool_requests",
            "Finished chat choices of requests with tools, by finish_reason.",
            ("finish_reason",),
        )
        self.tool_requests = {r: tools(r) for r in TOOL_FINISH_REASONS}
        self.tool_calls = naming.counter("tool_calls", "Tool calls in finished chat answers.")()
        constrained = naming.counter(
            "constrained_requests",
            "Finished requests with a structured output, by kind.",
            ("kind",),
        )
        self.constrained = {kind: constrained(kind) for kind in CONSTRAINT_KINDS}
        self.grammar_wait = naming.histogram(
            "grammar_compile_wait_seconds",
            "Time a structured-output request waited for its grammar to compile.",
            GRAMMAR_WAIT_BUCKETS,
            Histogram,
        )()

    def on_tokens(
        self, state: ReqState, num_tokens: int, previous_token_time: float | None, now: float
    ) -> None:
        """A row with tokens reached the API: TTFT on the first, ITL per token after (tallied
        for ``end_frame``)."""
        if previous_token_time is None:
            self.ttft[state.stream].observe(now - state.created_time)
        elif num_tokens:
            per_token = (now - previous_token_time) / num_tokens
            tally = self._itl_tally
            tally[per_token] = tally.get(per_token, 0) + num_tokens

    def end_frame(self) -> None:
        """The frame's rows are all applied: observe its ITL tally, one update per gap."""
        tally, self._itl_tally = self._itl_tally, {}
        for per_token, count in tally.items():
            self.itl.observe_many(per_token, count)

    def on_sse_stream(self, direct: bool) -> None:
        """A stream started: its events go straight to the client's socket (``direct``) or
        through ASGI ``send``."""
        self.sse_streams["direct" if direct else "asgi"].inc()

    def on_rejected(self, reason: str) -> None:
        """A request refused by a limit before it ran, one of ``REJECTION_REASONS``."""
        self.num_rejected[reason].inc()

    def on_lost(self, state: ReqState) -> None:
        """A request that ended before the scheduler reported on it (a restarted scheduler
        lost it): a request and an abort, with no token counts or timings to observe."""
        self.num_requests[state.stream].inc()
        self.num_aborted.inc()
        self.peers.on_lost(state)

    def on_tool_answer(self, finish_reason: str, calls: int) -> None:
        """A finished chat choice of a request with tools
        (``tokenizer_proc.openai.chat_answers``)."""
        self.tool_requests[finish_reason].inc()
        if calls:
            self.tool_calls.inc(calls)

    def on_finish(self, state: ReqState) -> None:
        stats = state.request_stats
        assert stats is not None and state.finished_time is not None
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(state.completion_tokens)
        details = stats.cached_tokens_details
        if details is not None:
            self.cached_tokens["device"].inc(details.device)
            self.cached_tokens["host"].inc(details.host)
            self.cached_tokens["storage"].inc(details.storage or 0)
        self.cached_tokens["total"].inc(stats.cached_tokens)
        self.num_requests[state.stream].inc()
        if isinstance(state.finished_reason, FinishAbort):
            self.num_aborted.inc()
        self.e2e[state.stream].observe(state.finished_time - state.created_time)
        if stats.time_stats is not None:
            # The scheduler's decode interval, as meta_info's decode_throughput: the API's own
            # token times are one instant for a non-streaming request (its only row is the last).
            per_token = time_per_output_token(state.completion_tokens, stats.time_stats)
            if per_token is not None:
                self.tpot.observe(per_token)
            self.queue_time.observe(stats.time_stats.queue_time)
        if state.constraint_kind is not None:
            self.constrained[state.constraint_kind].inc()
            if stats.time_stats is not None:
                self.grammar_wait.observe(stats.time_stats.grammar_wait)
        self.num_retractions.observe(stats.num_retractions)
        self.prompt_tokens_hist.observe(stats.prompt_tokens)
        self.generation_tokens_hist.observe(state.completion_tokens)
        self.peers.on_finish(state)


class RequestPeerSeries:
    """A peer family's series that tokenpipe makes only for it, from each finished request's
    state as the rest: vLLM's requests by finish reason, prefix-cache queries and hits, request
    parameters and phase times; the uncached prompt tokens (both); the token sources
    (``TokenSourceSeries``). ``ABSENT`` stands in for the ones the family lacks (all of them for
    tokenpipe's own names)."""

    def __init__(self, naming: Naming) -> None:
        success = naming.peer_counter(
            "request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        self.request_success: dict[str, Counter | Absent] = {
            r: success(r) if success is not None else ABSENT for r in VLLM_FINISH_REASONS
        }
        self.prefix_cache_queries = one_child(
            naming.peer_counter(
                "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
            )
        )
        self.prefix_cache_hits = one_child(
            naming.peer_counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        )
        self.params_n = one_child(
            naming.peer_histogram("request_params_n", "Choices per request (n).", Histogram)
        )
        self.params_max_tokens = one_child(
            naming.peer_histogram("request_params_max_tokens", "Requested max tokens.", Histogram)
        )
        self.max_generation_tokens = one_child(
            naming.peer_histogram(
                "request_max_num_generation_tokens",
                "Generated tokens of a request's longest choice.",
                Histogram,
            )
        )
        self.prefill_time = one_child(
            naming.peer_histogram(
                "request_prefill_time_seconds", "First forward to the prefill's end.", Histogram
            )
        )
        self.decode_time = one_child(
            naming.peer_histogram(
                "request_decode_time_seconds", "The prefill's end to the finish.", Histogram
            )
        )
        self.inference_time = one_child(
            naming.peer_histogram(
                "request_inference_time_seconds", "First forward to the finish.", Histogram
            )
        )
        self.uncached_prompt_tokens = one_child(
            naming.peer_histogram(
                "uncached_prompt_tokens_histogram",
                "Prompt tokens per request not served by the cache.",
                Histogram,
            )
        )
        self.token_sources = TokenSourceSeries(naming)

    def on_lost(self, state: ReqState) -> None:
        """A request lost before the scheduler reported on it: an abort, and no tokens."""
        self.request_success["abort"].inc()
        self._end_choice(state, 0)

    def _end_choice(self, state: ReqState, completion_tokens: int) -> None:
        """vLLM's request parameters. ``max_tokens`` is observed per choice, as vLLM observes
        it per child request (the API runs each choice as a pipeline request of its own, as
        vLLM's engine runs each child); ``n`` and the longest choice's tokens once per
        request, so a choice of n > 1 waits for the rest of its group."""
        self.params_max_tokens.observe(state.sampling.max_new_tokens)
        group = state.choices
        if group is None:
            n, longest = 1, completion_tokens
        elif group.end_choice(completion_tokens):
            n, longest = group.n, group.longest
        else:
            return
        self.params_n.observe(n)
        self.max_generation_tokens.observe(longest)

    def on_finish(self, state: ReqState) -> None:
        stats = state.request_stats
        assert stats is not None and state.finished_reason is not None
        self.request_success[str(type(state.finished_reason).__struct_config__.tag)].inc()
        self.prefix_cache_queries.inc(stats.prompt_tokens)
        self.prefix_cache_hits.inc(stats.cached_tokens)
        self._end_choice(state, state.completion_tokens)
        self.uncached_prompt_tokens.observe(stats.prompt_tokens - stats.cached_tokens)
        self.token_sources.on_finish(stats.prompt_tokens, stats.cached_tokens, state)
        ts = stats.time_stats
        if ts is None or ts.forward_entry_time is None or ts.completion_time is None:
            return  # metrics off, or it ended before it ran
        self.inference_time.observe(ts.completion_time - ts.forward_entry_time)
        if ts.prefill_finished_time is not None:
            self.prefill_time.observe(ts.prefill_finished_time - ts.forward_entry_time)
            self.decode_time.observe(ts.completion_time - ts.prefill_finished_time)


class TokenSourceSeries:
    """Where each finished request's tokens came from, as the peers split them. vLLM: prompt
    tokens by source (computed, or a local cache hit; tokenpipe has no KV connector, so none
    come from an external transfer), the cached ones, and those ``recomputed``: vLLM counts
    one when all but the last prompt token came from the cache, since a forward needs one
    input (tokenpipe never matches a prompt's last token, for its logits: the same case).
    SGLang: the tokens processed by mode (prefill computed, prefill from the cache, decoded),
    counted when the request ends where SGLang counts each report interval."""

    SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
    MODES = ("prefill_compute", "prefill_cache", "decode")

    def __init__(self, naming: Naming) -> None:
        by_source = naming.peer_counter(
            "prompt_tokens_by_source", "Prompt tokens by source.", ("source",)
        )
        self.by_source: dict[str, Counter | Absent] = {
            s: by_source(s) if by_source is not None else ABSENT for s in self.SOURCES
        }
        self.cached = one_child(
            naming.peer_counter("prompt_tokens_cached", "Prompt tokens served from the cache.")
        )
        self.recomputed = one_child(
            naming.peer_counter(
                "prompt_tokens_recomputed", "Cached prompt tokens computed again for a forward."
            )
        )
        realtime = naming.peer_counter("realtime_tokens", "Tokens processed, by mode.", ("mode",))
        self.realtime: dict[str, Counter | Absent] = {
            m: realtime(m) if realtime is not None else ABSENT for m in self.MODES
        }

    def on_finish(self, prompt: int, cached: int, state: ReqState) -> None:
        recomputed = 1 if cached + 1 == prompt else 0
        self.by_source["local_compute"].inc(prompt - cached)
        self.by_source["local_cache_hit"].inc(cached + recomputed)
        self.cached.inc(cached)
        self.recomputed.inc(recomputed)
        self.realtime["prefill_compute"].inc(prompt - cached)
        self.realtime["prefill_cache"].inc(cached)
        self.realtime["decode"].inc(state.completion_tokens)
