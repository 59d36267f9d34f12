"""Which names ``/metrics`` serves (``--metrics-compat``, docs/design.md section 7).

A family changes names, label names and bucket boundaries, never values: every series is
still fed from the same ``ReqState`` and scheduler reports (``request_metrics.py``,
``scheduler_gauges.py``), so dashboards, alerts and autoscalers written for SGLang or vLLM
read tokenpipe unchanged and the totals still equal the sums of meta_info.

``FAMILIES`` is the one table; ``Naming`` resolves it for one server. The names, label names
and buckets are the peers' own (vLLM's v1 Prometheus logger, SGLang's metrics collector, and
their Grafana dashboards; the buckets in ``tokenizer_proc/peer_buckets.py``); what each peer
series means there and here: the table in docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from pipeline.config import MetricsCompat
from tokenizer_proc.peer_buckets import (
    SGLANG_E2E,
    SGLANG_ITL,
    SGLANG_QUEUE,
    SGLANG_TOKEN_COUNTS,
    SGLANG_TTFT,
    VLLM_ITERATION_TOKENS,
    VLLM_ITL,
    VLLM_N,
    VLLM_REQUEST_LATENCY,
    VLLM_TTFT,
    one_two_five,
)

OWN_PREFIX = "tokenpipe:"

# Boundaries that grow with the served context length (vLLM's token-count histograms).
Buckets = tuple[float, ...] | Callable[[int], tuple[float, ...]]


# Which of a family's label sets a series carries (``Family.label_sets``): a request's, the
# scheduler's (SGLang labels its scheduler's series by parallel rank too), a config info
# gauge's (vLLM's carries its engine and no model name), or none (vLLM's lora_requests_info
# carries only its own labels).
LabelSet = Literal["request", "scheduler", "info", "bare"]


@dataclass(frozen=True, slots=True)
class Series:
    """One series as a family names it."""

    name: str  # the whole name, prefix included
    # The family's names for the extra labels the code gives (tokenpipe's, in its order); ""
    # drops one, and the values that differed only in it add up. None: the code's names.
    labels: tuple[str, ...] | None = None
    buckets: Buckets | None = None  # None: the code's own
    label_set: LabelSet = "request"


@dataclass(frozen=True, slots=True)
class Family:
    """Per family, by tokenpipe's name without the prefix: the tokenpipe series it has a
    counterpart for, and under names tokenpipe has not, the series of its own that tokenpipe
    computes only for it (``Naming.peer_*``). A tokenpipe series the family lacks keeps its
    ``tokenpipe:`` name and labels: nothing is lost, and no name is made up in a peer's
    namespace. Counters are listed without ``_total``, which prometheus-client appends."""

    # The labels each kind of series of the family carries, from (model_name, engine_type).
    label_sets: Mapping[LabelSet, Callable[[str, str], dict[str, str]]]
    series: Mapping[str, Series]

    def base_labels(self, label_set: LabelSet, model_name: str, engine_type: str) -> dict[str, str]:
        return self.label_sets[label_set](model_name, engine_type)


def _labels_with_engine_type(model_name: str, engine_type: str) -> dict[str, str]:
    return {"model_name": model_name, "engine_type": engine_type}


def _sglang_scheduler_labels(model_name: str, engine_type: str) -> dict[str, str]:
    # SGLang's scheduler labels its series by its place in the parallel layout; tokenpipe runs
    # the model whole, in one process: rank 0 of each.
    ranks = {"tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
    return {**_labels_with_engine_type(model_name, engine_type), **ranks}


def _vllm_labels(model_name: str, engine_type: str) -> dict[str, str]:
    # vLLM labels its series by engine index; tokenpipe is one engine. The role of a PD
    # server has no vLLM label (vLLM's disaggregated servers are told apart by instance).
    return {"model_name": model_name, "engine": "0"}


def _vllm_info_labels(model_name: str, engine_type: str) -> dict[str, str]:
    return {"engine": "0"}  # vLLM's cache_config_info: the engine and the config, no model


def _no_labels(model_name: str, engine_type: str) -> dict[str, str]:
    return {}


def _same_names(prefix: str, *keys: str, label_set: LabelSet = "request") -> dict[str, Series]:
    return {key: Series(prefix + key, label_set=label_set) for key in keys}


SGLANG = Family(
    MappingProxyType(
        {
            "request": _labels_with_engine_type,
            "scheduler": _sglang_scheduler_labels,
            "info": _labels_with_engine_type,
        }
    ),
    MappingProxyType(
        {
            # tokenpipe took its names from SGLang: the same names, SGLang's buckets. Those of
            # its scheduler carry the scheduler's labels.
            **_same_names(
                "sglang:",
                "num_running_reqs",
                "token_usage",
                "cache_hit_rate",
                "gen_throughput",
                "num_retracted_reqs",
                "num_retracted_requests",
                label_set="scheduler",
            ),  # fmt: skip
            **_same_names(
                "sglang:",
                "prompt_tokens",
                "generation_tokens",
                "cached_tokens",
                "num_aborted_requests",
                "num_retractions",
            ),  # fmt: skip
            # SGLang splits no request series by streaming.
            "num_requests": Series("sglang:num_requests", labels=("",)),
            "time_to_first_token_seconds": Series(
                "sglang:time_to_first_token_seconds", labels=("",), buckets=SGLANG_TTFT
            ),
            "inter_token_latency_seconds": Series(
                "sglang:inter_token_latency_seconds", buckets=SGLANG_ITL
            ),
            "e2e_request_latency_seconds": Series(
                "sglang:e2e_request_latency_seconds", labels=("",), buckets=SGLANG_E2E
            ),
            # SGLang's source gives no buckets of its own for this one: those of ITL, its unit.
            "request_time_per_output_token_seconds": Series(
                "sglang:request_time_per_output_token_seconds", buckets=SGLANG_ITL
            ),
            "queue_time_seconds": Series(
                "sglang:queue_time_seconds", buckets=SGLANG_QUEUE, label_set="scheduler"
            ),
            "prompt_tokens_histogram": Series(
                "sglang:prompt_tokens_histogram", buckets=SGLANG_TOKEN_COUNTS
            ),
            "generation_tokens_histogram": Series(
                "sglang:generation_tokens_histogram", buckets=SGLANG_TOKEN_COUNTS
            ),
            # Structured-output requests, whatever their kind.
            "constrained_requests": Series("sglang:num_so_requests", labels=("",)),
            # SGLang's own. Its waiting queue holds no request whose grammar still compiles
            # (tokenpipe's num_queue_reqs does, and keeps its own name here).
            **_same_names(
                "sglang:",
                "num_used_tokens",
                "max_total_num_tokens",
                "num_grammar_queue_reqs",
                "decode_sum_seq_lens",
                "realtime_tokens",
                "num_paused_reqs",
                label_set="scheduler",
            ),
            "num_queue_reqs_without_grammar": Series(
                "sglang:num_queue_reqs", label_set="scheduler"
            ),
            "uncached_prompt_tokens_histogram": Series(
                "sglang:uncached_prompt_tokens_histogram", buckets=SGLANG_TOKEN_COUNTS
            ),
            # Speculative decoding, over each report's interval (tokenizer_proc/spec_metrics.py).
            **_same_names(
                "sglang:", "spec_accept_length", "spec_accept_rate", label_set="scheduler"
            ),
        }
    ),
)

VLLM = Family(
    MappingProxyType(
        {
            "request": _vllm_labels,
            "scheduler": _vllm_labels,
            "info": _vllm_info_labels,
            "bare": _no_labels,
        }
    ),
    MappingProxyType(
        {
            "num_running_reqs": Series("vllm:num_requests_running"),
            "num_queue_reqs": Series("vllm:num_requests_waiting"),
            "token_usage": Series("vllm:kv_cache_usage_perc"),  # a fraction, as tokenpipe's
            "num_retracted_requests": Series("vllm:num_preemptions"),
            "prompt_tokens": Series("vllm:prompt_tokens"),
            "generation_tokens": Series("vllm:generation_tokens"),
            # vLLM splits no latency by streaming.
            "time_to_first_token_seconds": Series(
                "vllm:time_to_first_token_seconds", labels=("",), buckets=VLLM_TTFT
            ),
            "inter_token_latency_seconds": Series(
                "vllm:inter_token_latency_seconds", buckets=VLLM_ITL
            ),
            "e2e_request_latency_seconds": Series(
                "vllm:e2e_request_latency_seconds", labels=("",), buckets=VLLM_REQUEST_LATENCY
            ),
            "request_time_per_output_token_seconds": Series(
                "vllm:request_time_per_output_token_seconds", buckets=VLLM_ITL
            ),
            "queue_time_seconds": Series(
                "vllm:request_queue_time_seconds", buckets=VLLM_REQUEST_LATENCY
            ),
            "prompt_tokens_histogram": Series("vllm:request_prompt_tokens", buckets=one_two_five),
            "generation_tokens_histogram": Series(
                "vllm:request_generation_tokens", buckets=one_two_five
            ),
            # vLLM's own.
            "request_success": Series("vllm:request_success"),
            "prefix_cache_queries": Series("vllm:prefix_cache_queries"),
            "prefix_cache_hits": Series("vllm:prefix_cache_hits"),
            "iteration_tokens": Series(
                "vllm:iteration_tokens_total", buckets=VLLM_ITERATION_TOKENS
            ),
            "request_params_n": Series("vllm:request_params_n", buckets=VLLM_N),
            "request_params_max_tokens": Series(
                "vllm:request_params_max_tokens", buckets=one_two_five
            ),
            "request_max_num_generation_tokens": Series(
                "vllm:request_max_num_generation_tokens", buckets=one_two_five
            ),
            "request_prefill_time_seconds": Series(
                "vllm:request_prefill_time_seconds", buckets=VLLM_REQUEST_LATENCY
            ),
            "request_decode_time_seconds": Series(
                "vllm:request_decode_time_seconds", buckets=VLLM_REQUEST_LATENCY
            ),
            "request_inference_time_seconds": Series(
                "vllm:request_inference_time_seconds", buckets=VLLM_REQUEST_LATENCY
            ),
            "uncached_prompt_tokens_histogram": Series(
                "vllm:request_prefill_kv_computed_tokens", buckets=one_two_five
            ),
            "prompt_tokens_by_source": Series("vllm:prompt_tokens_by_source"),
            "prompt_tokens_cached": Series("vllm:prompt_tokens_cached"),
            "prompt_tokens_recomputed": Series("vllm:prompt_tokens_recomputed"),
            "num_requests_waiting_by_reason": Series("vllm:num_requests_waiting_by_reason"),
            "cache_config_info": Series("vllm:cache_config_info", label_set="info"),
            "lora_requests_info": Series("vllm:lora_requests_info", label_set="bare"),
            # Speculative decoding's counters, vLLM's position label 0 for the first draft.
            **_same_names(
                "vllm:",
                "spec_decode_num_drafts",
                "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens",
                "spec_decode_num_accepted_tokens_per_pos",
            ),
        }
    ),
)

TOKENPIPE = Family(
    MappingProxyType(dict.fromkeys(("request", "scheduler", "info"), _labels_with_engine_type)),
    MappingProxyType({}),
)

FAMILIES: Mapping[MetricsCompat, Family] = MappingProxyType(
    {"tokenpipe": TOKENPIPE, "sglang": SGLANG, "vllm": VLLM}
)

M = TypeVar("M", bound=MetricWrapperBase)


class Bound(Generic[M]):
    """A registered metric and what a tokenpipe label set becomes in it: ``bound(*values)`` is
    the child for the values of the code's extra labels (a dropped label's value is ignored)."""

    __slots__ = ("_base", "_metric", "_names")

    def __init__(self, metric: M, base: dict[str, str], names: tuple[str, ...]) -> None:
        self._metric = metric
        self._base = base
        self._names = names

    def __call__(self, *values: str) -> M:
        return self._metric.labels(**self._base, **self._extra(values))

    def remove(self, *values: str) -> None:
        """Drops the child of these values (in the order the labels were registered)."""
        self._metric.remove(*self._base.values(), *self._extra(values).values())

    def _extra(self, values: tuple[str, ...]) -> dict[str, str]:
        return {name: value for name, value in zip(self._names, values, strict=True) if name}


class Absent:
    """A series of a peer family that the chosen family does not have: updates go nowhere."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def observe_many(self, amount: float, count: int) -> None:
        pass


ABSENT = Absent()


def one_child(bound: Bound[M] | None) -> M | Absent:
    """The one child of a peer-only series, or ``ABSENT`` when the family has no such series."""
    return bound() if bound is not None else ABSENT


H = TypeVar("H", bound=Histogram)


class Naming:
    """``--metrics-compat`` resolved for one server: the name, labels and buckets each series
    is registered with. ``counter``, ``gauge`` and ``histogram`` take a tokenpipe series;
    ``peer_*`` a family's own, and give None when the family has no such series."""

    def __init__(
        self,
        compat: MetricsCompat,
        registry: CollectorRegistry,
        model_name: str,
        engine_type: str,
        context_length: int,
    ) -> None:
        self.registry = registry
        self._family = FAMILIES[compat]
        self._model_name = model_name
        self._engine_type = engine_type
        self._context_length = context_length

    def counter(self, key: str, doc: str, extra: tuple[str, ...] = ()) -> Bound[Counter]:
        name, base, names, _ = self._resolve(key, extra, None)
        return Bound(
            Counter(name, doc, [*base, *(n for n in names if n)], registry=self.registry),
            base,
            names,
        )

    def gauge(self, key: str, doc: str, extra: tuple[str, ...] = ()) -> Bound[Gauge]:
        # Set by one API worker only (docs/design.md section 7): its latest value is the one.
        name, base, names, _ = self._resolve(key, extra, None)
        return Bound(
            Gauge(
                name,
                doc,
                [*base, *(n for n in names if n)],
                registry=self.registry,
                multiprocess_mode="mostrecent",
            ),
            base,
            names,
        )

    def histogram(
        self,
        key: str,
        doc: str,
        buckets: tuple[float, ...],
        cls: type[H],
        extra: tuple[str, ...] = (),
    ) -> Bound[H]:
        name, base, names, chosen = self._resolve(key, extra, buckets)
        assert chosen is not None
        return Bound(
            cls(
                name, doc, [*base, *(n for n in names if n)], buckets=chosen, registry=self.registry
            ),
            base,
            names,
        )

    def peer_counter(
        self, key: str, doc: str, extra: tuple[str, ...] = ()
    ) -> Bound[Counter] | None:
        return self.counter(key, doc, extra) if key in self._family.series else None

    def peer_gauge(self, key: str, doc: str, extra: tuple[str, ...] = ()) -> Bound[Gauge] | None:
        return self.gauge(key, doc, extra) if key in self._family.series else None

    def peer_histogram(self, key: str, doc: str, cls: type[H]) -> Bound[H] | None:
        series = self._family.series.get(key)
        if series is None:
            return None
        assert series.buckets is not None, f"{series.name} lists no buckets"
        return self.histogram(key, doc, (), cls)

    def _resolve(
        self, key: str, extra: tuple[str, ...], buckets: tuple[float, ...] | None
    ) -> tuple[str, dict[str, str], tuple[str, ...], tuple[float, ...] | None]:
        """(name, base labels, extra label names, buckets) of the series ``key``."""
        series = self._family.series.get(key)
        if series is None:
            own = TOKENPIPE.base_labels("request", self._model_name, self._engine_type)
            return OWN_PREFIX + key, own, extra, buckets
        names = series.labels if series.labels is not None else extra
        assert len(names) == len(extra), (
            f"{series.name}: {len(extra)} extra labels, the table names {len(names)}"
        )
        chosen = series.buckets if series.buckets is not None else buckets
        if callable(chosen):
            assert self._context_length > 0, (
                f"{series.name}'s buckets reach the context length: give it"
            )
            chosen = chosen(self._context_length)
        base = self._family.base_labels(series.label_set, self._model_name, self._engine_type)
        return series.name, base, names, chosen
