"""What a request is checked for, and made into, before ``TokenizerManager`` submits it:
its prompt tokenized and held to the vocabulary, its sampling held to the server's limits
(the context, ``--max-new-tokens-limit``, the KV pool), and what a PD half of it computes.

Every refusal is a ``RequestValidationError`` naming the native API's field; the OpenAI
routes rename the fields to their own (``tokenizer_proc.openai.jobs.openai_names``). Those the
peers word differently (the context, the vocabulary, a max_new_tokens refused) are
``PeerWordedError``s, in both peers' words (``request_edge.peer_wording``).

Under ``--skip-tokenizer-init`` there is no tokenizer: whatever needs text (a text prompt,
stop strings, media placeholders, chat templates, /tokenize, structured outputs) is refused
with a 400 from ``without_tokenizer``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from pipeline.config import ServerConfig
from pipeline.io_struct import Constraint, LogprobParams, MediaItem, SamplingParams
from pipeline.tokenizer_loader import LoadedTokenizer
from tokenizer_proc.request_edge.bootstrap import Bootstrap
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.peer_wording import (
    PeerWordedError,
    context_overflow,
    max_tokens_over_limit,
    out_of_vocabulary,
)


class ContextLengthError(PeerWordedError):
    """A prompt plus its max_new_tokens beyond the context, in both peers' words
    (``peer_wording.context_overflow``): SGLang's first, as the native API answers it;
    ``for_route`` words it for the OpenAI routes, vLLM's first, with their field names."""

    def __init__(self, prompt_len: int, max_new_tokens: int, context_length: int) -> None:
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        # The prompt leaves no room for any output.
        self.prompt_alone = prompt_len >= context_length
        super().__init__(
            context_overflow(prompt_len, max_new_tokens, context_length),
            self._detail("prompt", "sampling_params.max_new_tokens"),
            "text" if self.prompt_alone else "sampling_params.max_new_tokens",
        )

    def _detail(self, prompt_param: str, max_param: str) -> str:
        return f"({prompt_param}: {self.prompt_len} tokens; {max_param}: {self.max_new_tokens})"

    def for_route(self, prompt_param: str, max_param: str) -> PeerWordedError:
        return PeerWordedError(
            self.phrases,
            self._detail(prompt_param, max_param),
            prompt_param if self.prompt_alone else max_param,
            lead="vllm",
        )


class OutOfVocabularyError(PeerWordedError):
    """Prompt token ids not below the vocabulary size, in both peers' words
    (``peer_wording.out_of_vocabulary``); ``for_route`` as for ``ContextLengthError``."""

    def __init__(self, ids: Sequence[int], vocab_size: int) -> None:
        bad = [(i, token) for i, token in enumerate(ids) if token >= vocab_size]
        self.first_position = bad[0][0]
        self.vocab_size = vocab_size
        phrases = out_of_vocabulary("input_ids", [token for _, token in bad], vocab_size)
        super().__init__(phrases, self._detail("input_ids"), "input_ids")

    def _detail(self, prompt_param: str) -> str:
        return (
            f"(the first at {prompt_param} position {self.first_position}; token ids must be "
            f"below {self.vocab_size})"
        )

    def for_route(self, prompt_param: str) -> PeerWordedError:
        return PeerWordedError(self.phrases, self._detail(prompt_param), prompt_param, lead="vllm")


def without_tokenizer(needs: str, param: str) -> RequestValidationError:
    """The 400 for a request that needs what only a tokenizer gives, on a server that
    runs with --skip-tokenizer-init. ``needs`` says what needed it and what to do instead."""
    return RequestValidationError(
        f"this server runs with --skip-tokenizer-init and loads no tokenizer: {needs}", param
    )


class RequestChecks:
    """The checks of one server: its config, tokenizer (None under --skip-tokenizer-init),
    vocabulary size and context length, all fixed for the process's life."""

    def __init__(
        self,
        config: ServerConfig,
        tokenizer: LoadedTokenizer | None,
        *,
        vocab_size: int,
        context_length: int,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length

    def require_tokenizer(self, needs: str, param: str) -> LoadedTokenizer:
        if self.tokenizer is None:
            raise without_tokenizer(needs, param)
        return self.tokenizer

    def tokenize(
        self, text: str | None, input_ids: list[int] | None, *, add_special_tokens: bool
    ) -> list[int]:
        """The prompt's ids. ``add_special_tokens``: whether a text prompt gets the tokenizer's
        post-processor tokens (a Llama tokenizer's BOS); each route passes its own API's
        default or the request's field, never a default of this function's (token ids are
        taken as they are)."""
        if (text is None) == (input_ids is None):
            raise RequestValidationError("give exactly one of `text` and `input_ids`", "text")
        if text is not None:
            tokenizer = self.require_tokenizer("it takes prompts as token ids, not text", "text")
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        else:
            ids = list(input_ids or [])
        if not ids:
            raise RequestValidationError(
                "the prompt is empty: `text` must encode to at least one token", "text"
            )
        if input_ids is not None and max(ids) >= self.vocab_size:
            raise OutOfVocabularyError(ids, self.vocab_size)
        return ids

    def media_token_ids(self, items: Sequence[MediaItem]) -> Mapping[str, int]:
        """The placeholder token id of each media kind, for ``media.expand_prompt``. Without a
        tokenizer there are none to know, so media is refused, naming its field."""
        if self.tokenizer is not None:
            return self.tokenizer.media_token_ids
        if items:
            kind = items[0].kind
            raise without_tokenizer(
                f"it has no <|{kind}|> placeholder token id for {kind}_data; send the request "
                "without media",
                f"{kind}_data",
            )
        return {}

    def validate_sampling(self, prompt_len: int, sampling: SamplingParams) -> None:
        """Everything a generate request is checked for before it is submitted."""
        if sampling.stop and self.tokenizer is None:
            raise without_tokenizer(
                "sampling_params.stop needs one to match text; stop on token ids with "
                "stop_token_ids",
                "sampling_params.stop",
            )
        self.require_vocabulary(
            "stop_token_ids", sampling.stop_token_ids, "sampling_params.stop_token_ids"
        )
        self.require_vocabulary(
            "logit_bias", [token for token, _ in sampling.logit_bias], "sampling_params.logit_bias"
        )
        self.validate_thinking_budget(sampling)
        self.validate_lengths(prompt_len, sampling)

    def require_vocabulary(self, field: str, ids: Sequence[int], param: str) -> None:
        """Every id of ``field`` (its native name; ``param``, its path) below the vocabulary
        size, else a 400 in both peers' words (vLLM refuses each such field; SGLang all but
        ``stop_token_ids``)."""
        bad = [token for token in ids if token >= self.vocab_size]
        if bad:
            raise PeerWordedError(
                out_of_vocabulary(field, bad, self.vocab_size),
                f"({param}: token ids must be below {self.vocab_size})",
                param,
            )

    def validate_thinking_budget(self, sampling: SamplingParams) -> None:
        """A budget (docs/design/sampling.md#thinking-budget) of at least 0 tokens, with the
        ids that end the reasoning, each in the vocabulary; not in --mode dllm."""
        budget, end = sampling.thinking_budget, sampling.thinking_end
        if budget is None:
            return
        param = "sampling_params.thinking_budget"
        if budget < 0:
            raise RequestValidationError(f"{param} is {budget}; it must be at least 0", param)
        if not end:
            raise RequestValidationError(
                f"{param} needs sampling_params.thinking_end, the token ids that end the reasoning",
                "sampling_params.thinking_end",
            )
        if min(end) < 0 or max(end) >= self.vocab_size:
            bad = next(t for t in end if not 0 <= t < self.vocab_size)
            raise RequestValidationError(
                f"sampling_params.thinking_end names token id {bad}, not in the vocabulary "
                f"[0, {self.vocab_size})",
                "sampling_params.thinking_end",
            )
        if self.config.mode == "dllm":
            raise RequestValidationError(
                f"{param} is not served in --mode dllm (a block commits its tokens out of "
                "order); send it to a server in --mode generate",
                param,
            )

    def validate_lengths(self, prompt_len: int, sampling: SamplingParams) -> None:
        """The context first: a request beyond it gets the peers' words, whatever else."""
        if prompt_len + sampling.max_new_tokens > self.context_length:
            raise ContextLengthError(prompt_len, sampling.max_new_tokens, self.context_length)
        limit = self.config.max_new_tokens_limit
        if sampling.max_new_tokens > limit:
            raise PeerWordedError(
                max_tokens_over_limit(sampling.max_new_tokens),
                f"(sampling_params.max_new_tokens is {sampling.max_new_tokens}; this server "
                f"allows at most {limit})",
                "sampling_params.max_new_tokens",
            )
        if (
            self.config.kv_tokens_needed(prompt_len, sampling.max_new_tokens)
            > self.config.max_total_tokens
        ):
            block = " (rounded up to whole dLLM blocks)" if self.config.mode == "dllm" else ""
            raise RequestValidationError(
                f"prompt ({prompt_len} tokens) plus max_new_tokens "
                f"({sampling.max_new_tokens}){block} can never fit the KV pool "
                f"({self.config.max_total_tokens} tokens)",
                "sampling_params.max_new_tokens",
            )

    def validate_priority(self, priority: int) -> None:
        """A priority other than 0 asks for priority scheduling, which the server's flags
        switch on (vLLM's check and wording)."""
        if priority != 0 and not self.config.priority_scheduling:
            raise RequestValidationError(
                f"Got priority {priority} but Priority scheduling is not enabled: start the "
                "server with --scheduling-policy priority (or --enable-priority-scheduling)",
                "priority",
            )

    def validate_constraint(self, constraint: Constraint | None) -> None:
        """What a structured output needs of the server, checked before anything is
        submitted; whether its spec compiles is the scheduler's answer."""
        if constraint is None:
            return
        if self.tokenizer is None:
            # The grammar is compiled over the vocabulary's token texts, which only a
            # tokenizer has.
            raise without_tokenizer(
                f"{constraint.param} needs one to compile a structured output over its token "
                "texts; send the request without a constraint",
                constraint.param,
            )
        if self.config.mode == "dllm":
            # A block unmasks its positions out of order, and a grammar accepts tokens in order.
            raise RequestValidationError(
                f"{constraint.param}: structured outputs are not served in --mode dllm (a block "
                "commits its tokens out of order); send it to a server in --mode generate",
                constraint.param,
            )

    def validate_logprobs(self, logprobs: LogprobParams | None) -> None:
        if logprobs is not None and logprobs.token_ids_logprob:
            self.require_vocabulary(
                "token_ids_logprob", logprobs.token_ids_logprob, "token_ids_logprob"
            )

    def answered_logprobs(
        self, logprobs: LogprobParams | None, bootstrap: Bootstrap | None
    ) -> LogprobParams | None:
        """The logprobs a request's own answer lists: those it asked, except on a PD prefill
        half (a prefill server's request with a bootstrap room), whose answer lists its
        first token's only. Its scheduler still computes the prompt's, and they travel with
        the KV to the decode server, whose first row carries them (docs/design.md section 11).

        Why not both: sglang-router, in PD mode, puts the prefill answer's
        ``input_token_logprobs`` in front of the decode answer's (non-streaming /generate),
        so a prompt listed by both would show every position twice, and a prompt listed by
        the prefill side only would be missing from a stream (the router streams the decode
        side's events). The decode answer is the one every client reads, so it lists them;
        the router then has nothing to join, and its answer equals a unified server's."""
        if logprobs is None or bootstrap is None or self.config.disaggregation_mode != "prefill":
            return logprobs
        return msgspec.structs.replace(logprobs, logprob_start_len=-1)

    def pd_half(
        self, sampling: SamplingParams, bootstrap: Bootstrap | None, internal: bool
    ) -> tuple[SamplingParams, Bootstrap | None]:
        """A prefill server computes the prompt's KV and the first token only, whatever the
        request asked (the decode server generates the rest). A decode server takes only
        requests it can fetch KV for (its own health check prefills locally)."""
        mode = self.config.disaggregation_mode
        if mode != "null" and sampling.max_new_tokens == 0:
            # The pair always hands over a first token, so a prompt scored without a
            # completion is a unified server's work.
            raise RequestValidationError(
                "sampling_params.max_new_tokens 0 (scoring the prompt) is not served through PD "
                "disaggregation; send it to a unified server",
                "sampling_params.max_new_tokens",
            )
        if mode == "prefill":
            return msgspec.structs.replace(sampling, max_new_tokens=1, min_new_tokens=0), bootstrap
        if mode == "decode":
            if bootstrap is None and not internal:
                raise RequestValidationError(
                    "this server runs --disaggregation-mode decode: a request needs "
                    "bootstrap_room and bootstrap_endpoint (or bootstrap_host and "
                    "bootstrap_port); send requests through sglang-router with --pd-disaggregation",
                    "bootstrap_room",
                )
            return sampling, bootstrap
        return sampling, None  # a unified server computes everything itself
