"""Speculative decoding's settings, as both peers spell them: vLLM's ``--speculative-config``
JSON (``method`` ``ngram`` or ``draft_model``, ``num_speculative_tokens``,
``prompt_lookup_min/max``, ``model``, ``disable_by_batch_size``) and SGLang's
``--speculative-algorithm NGRAM|STANDALONE`` with ``--speculative-num-draft-tokens``,
``--speculative-draft-model-path`` and the n-gram window flags. Parsed once, in the config
check, so a bad setting fails the start with the flag's name (docs/design/speculative.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

Method = Literal["ngram", "draft_model"]

# EAGLE, MTP and Medusa draft from heads trained on the target's hidden states: a server
# that has none can only refuse them.
_TRAINED_HEADS = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "dspark")
_VLLM_KEYS = frozenset(
    {
        "method",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "model",
        "disable_by_batch_size",
    }
)
_SGLANG_ALGORITHMS: dict[str, Method] = {"NGRAM": "ngram", "STANDALONE": "draft_model"}
DEFAULT_DRAFT_TOKENS = 4
# Above this many running requests a step decodes without drafts: on a CPU a verify pass
# of a large batch costs more than the tokens it saves (measured: docs/design/speculative.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: Method
    num_speculative_tokens: int  # drafts per request per step, at most
    prompt_lookup_min: int  # n-gram: the shortest suffix matched
    prompt_lookup_max: int  # n-gram: the longest suffix matched
    draft_model: str | None  # draft_model: the checkpoint directory
    disable_by_batch_size: int  # a step with more running requests drafts nothing


def _eagle_refusal(name: str, flag: str) -> ValueError:
    return ValueError(
        f"{flag}: {name!r} needs draft heads trained on this model's hidden states, which "
        "tokenpipe does not serve; use 'ngram' (prompt lookup) or a draft model "
        "(vLLM 'draft_model', SGLang STANDALONE)"
    )


def parse_speculative(
    vllm_json: str | None,
    algorithm: str | None,
    num_draft_tokens: int | None,
    draft_model_path: str | None,
    ngram_min: int | None,
    ngram_max: int | None,
    disable_by_batch_size: int | None,
) -> SpeculativeConfig | None:
    """The speculative settings of the flags (None: speculation off); ValueError naming the
    flag and the value that cannot be served."""
    if vllm_json is not None and algorithm is not None:
        raise ValueError("give --speculative-config or --speculative-algorithm, not both")
    if vllm_json is not None:
        return _from_vllm(vllm_json, disable_by_batch_size)
    if algorithm is None:
        if num_draft_tokens is not None or draft_model_path is not None:
            raise ValueError(
                "--speculative-num-draft-tokens and --speculative-draft-model-path need "
                "--speculative-algorithm"
            )
        return None
    name = algorithm.upper()
    if name.lower() in _TRAINED_HEADS:
        raise _eagle_refusal(algorithm, "--speculative-algorithm")
    method = _SGLANG_ALGORITHMS.get(name)
    if method is None:
        raise ValueError(f"--speculative-algorithm: {algorithm!r} is not one of NGRAM, STANDALONE")
    low = ngram_min if ngram_min is not None else 1
    return _checked(
        method,
        num_draft_tokens if num_draft_tokens is not None else DEFAULT_DRAFT_TOKENS,
        low,
        ngram_max if ngram_max is not None else max(low, 3),
        draft_model_path,
        disable_by_batch_size,
        "--speculative-algorithm",
    )


def _from_vllm(text: str, disable_by_batch_size: int | None) -> SpeculativeConfig:
    flag = "--speculative-config"
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: {text!r} is not valid JSON: {exc}") from exc
    if not isinstance(spec, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {text!r}")
    unknown = sorted(set(spec) - _VLLM_KEYS)
    if unknown:
        raise ValueError(f"{flag}: unsupported key(s) {', '.join(unknown)}")
    method = spec.get("method")
    if method is None:
        method = "draft_model" if spec.get("model") else None
    if not isinstance(method, str):
        raise ValueError(f"{flag}: 'method' must be 'ngram' or 'draft_model'")
    if method.lower() in _TRAINED_HEADS:
        raise _eagle_refusal(method, flag)
    if method not in ("ngram", "draft_model"):
        raise ValueError(f"{flag}: method {method!r} is not one of 'ngram', 'draft_model'")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int):
        raise ValueError(f"{flag}: 'num_speculative_tokens' must be an integer")
    # vLLM: either bound alone sets both; neither is 5 and 5.
    low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    low = low if low is not None else high if high is not None else 5
    high = high if high is not None else low
    by_size = spec.get("disable_by_batch_size", disable_by_batch_size)
    model = spec.get("model")
    return _checked(method, k, low, high, model, by_size, flag)  # type: ignore[arg-type]


def _checked(
    method: Method,
    k: int,
    low: int,
    high: int,
    model: str | None,
    disable_by_batch_size: int | None,
    flag: str,
) -> SpeculativeConfig:
    if not 1 <= k <= 16:
        raise ValueError(f"{flag}: the number of draft tokens must be 1 to 16, got {k}")
    if method == "ngram" and not 1 <= low <= high:
        raise ValueError(f"{flag}: n-gram windows need 1 <= min <= max, got {low} and {high}")
    if method == "draft_model" and not model:
        raise ValueError(f"{flag}: a draft model needs its checkpoint directory")
    if method == "ngram" and model:
        raise ValueError(f"{flag}: n-gram speculation takes no draft model")
    by_size = (
        DEFAULT_DISABLE_BY_BATCH_SIZE if disable_by_batch_size is None else disable_by_batch_size
    )
    if by_size < 0:
        raise ValueError(f"{flag}: disable_by_batch_size must be 0 or more, got {by_size}")
    return SpeculativeConfig(method, k, low, high, model, by_size)
