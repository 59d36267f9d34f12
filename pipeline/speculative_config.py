"""Speculative decoding's settings, as both peers spell them: vLLM's ``--speculative-config``
JSON (``method`` ``ngram`` or ``draft_model``, ``num_speculative_tokens``,
``prompt_lookup_min/max``, ``model``, and V0's ``disable_by_batch_size``) and SGLang's
``--speculative-algorithm NGRAM|STANDALONE`` with ``--speculative-num-draft-tokens`` (which
counts the verified token too, as SGLang's does), ``--speculative-num-steps``,
``--speculative-eagle-topk`` (1 only), ``--speculative-draft-model-path`` and the n-gram window
flags. Each dialect keeps its peer's defaults where the peer has one. Parsed in the config
check, so a bad setting fails the start with the flag's name (docs/operations.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Method = Literal["ngram", "draft_model"]

# EAGLE, MTP (SGLang: NEXTN), Medusa, DFlash and DSpark draft from heads trained on the
# target's hidden states: a server that has none can only refuse them. vLLM also takes
# model-specific MTP names (deepseek_mtp, ...), all ending in "_mtp".
_TRAINED_HEADS = frozenset(
    {"eagle", "eagle3", "mtp", "nextn", "medusa", "mlp_speculator", "dflash", "dspark"}
)
_VLLM_NGRAM = ("ngram", "[ngram]")  # vLLM reads both spellings as the n-gram method
_VLLM_METHODS: dict[str, Method] = {
    "ngram": "ngram",
    "[ngram]": "ngram",
    "draft_model": "draft_model",
}
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
MAX_DRAFT_TOKENS = 16
# Drafts per request per step when SGLang's flags give none (SGLang's --speculative-num-draft-
# tokens 5). SGLang's own NGRAM default is its max window (12 tokens, 11 drafts), sized for
# a GPU; a verify pass costs about its width where a step is compute-bound.
DEFAULT_DRAFT_TOKENS = 4
SGLANG_NGRAM_MIN_WINDOW = 1  # SGLang's defaults
SGLANG_NGRAM_MAX_WINDOW = 12
VLLM_PROMPT_LOOKUP = 5  # vLLM's: neither bound given sets both to 5
# Above this many running requests a step decodes without drafts: a verify pass of a large
# batch costs more than the tokens it saves. 0: no limit.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: Method
    num_speculative_tokens: int  # drafts per request per step, at most
    prompt_lookup_min: int  # n-gram: the shortest suffix matched
    prompt_lookup_max: int  # n-gram: the longest suffix matched
    draft_model: str | None  # draft_model: the checkpoint directory
    disable_by_batch_size: int  # a step with more running requests drafts nothing; 0: no limit


class SpeculativeFlags(Protocol):
    """The flags speculation is read from (``ServerConfig``'s fields of the same names)."""

    speculative_config: str | None
    speculative_algorithm: str | None
    speculative_num_draft_tokens: int | None
    speculative_num_steps: int | None
    speculative_eagle_topk: int | None
    speculative_draft_model_path: str | None
    speculative_ngram_min_match_window_size: int | None
    speculative_ngram_max_match_window_size: int | None
    speculative_disable_by_batch_size: int | None


def _needs_trained_heads(name: str) -> bool:
    name = name.lower()
    return name in _TRAINED_HEADS or name.endswith("_mtp")


def _eagle_refusal(name: str, flag: str) -> ValueError:
    return ValueError(
        f"{flag}: {name!r} needs draft heads trained on this model's hidden states, which "
        "tokenpipe does not serve; use n-gram prompt lookup (vLLM 'ngram', SGLang NGRAM) or a "
        "draft model (vLLM 'draft_model', SGLang STANDALONE)"
    )


def parse_speculative(flags: SpeculativeFlags) -> SpeculativeConfig | None:
    """The speculative settings of the flags (None: speculation off); ValueError naming the
    flag and the value that cannot be served."""
    if flags.speculative_config is not None and flags.speculative_algorithm is not None:
        raise ValueError(
            "give --speculative-config (vLLM's spelling) or --speculative-algorithm (SGLang's), "
            "not both"
        )
    _by_size(flags.speculative_disable_by_batch_size, "--speculative-disable-by-batch-size")
    if flags.speculative_algorithm is not None:
        return _from_sglang(flags.speculative_algorithm, flags)
    stray = [flag for flag, value in _sglang_only(flags) if value is not None]
    if stray:
        raise ValueError(
            f"{', '.join(stray)}: SGLang's spelling, which needs --speculative-algorithm "
            "(with --speculative-config, give these settings in its JSON)"
        )
    if flags.speculative_config is not None:
        return _from_vllm(flags.speculative_config, flags.speculative_disable_by_batch_size)
    if flags.speculative_disable_by_batch_size is not None:
        raise ValueError(
            "--speculative-disable-by-batch-size needs speculation on: give "
            "--speculative-config or --speculative-algorithm"
        )
    return None


def _sglang_only(flags: SpeculativeFlags) -> list[tuple[str, object]]:
    return [
        ("--speculative-num-draft-tokens", flags.speculative_num_draft_tokens),
        ("--speculative-num-steps", flags.speculative_num_steps),
        ("--speculative-eagle-topk", flags.speculative_eagle_topk),
        ("--speculative-draft-model-path", flags.speculative_draft_model_path),
        (
            "--speculative-ngram-min-match-window-size",
            flags.speculative_ngram_min_match_window_size,
        ),
        (
            "--speculative-ngram-max-match-window-size",
            flags.speculative_ngram_max_match_window_size,
        ),
    ]


def _from_sglang(algorithm: str, flags: SpeculativeFlags) -> SpeculativeConfig:
    flag = "--speculative-algorithm"
    if _needs_trained_heads(algorithm):
        raise _eagle_refusal(algorithm, flag)
    method = _SGLANG_ALGORITHMS.get(algorithm.upper())
    if method is None:
        raise ValueError(f"{flag}: {algorithm!r} is not one of NGRAM, STANDALONE")
    topk = flags.speculative_eagle_topk
    if topk is not None and topk != 1:
        raise ValueError(
            f"--speculative-eagle-topk: tokenpipe drafts one chain per request (top-k 1), not "
            f"a tree; got {topk}"
        )
    low = flags.speculative_ngram_min_match_window_size
    high = flags.speculative_ngram_max_match_window_size
    low = SGLANG_NGRAM_MIN_WINDOW if low is None else low
    high = SGLANG_NGRAM_MAX_WINDOW if high is None else high
    if not 1 <= low <= high:
        raise ValueError(
            "--speculative-ngram-min-match-window-size and --speculative-ngram-max-match-"
            f"window-size need 1 <= min <= max (defaults 1 and 12), got {low} and {high}"
        )
    return _checked(
        method,
        _sglang_drafts(method, flags.speculative_num_draft_tokens, flags.speculative_num_steps),
        low,
        high,
        (flags.speculative_draft_model_path, "--speculative-draft-model-path"),
        flags.speculative_disable_by_batch_size,
    )


def _sglang_drafts(method: Method, num_draft_tokens: int | None, num_steps: int | None) -> int:
    """Drafts per step from SGLang's flags. Its --speculative-num-draft-tokens counts the
    verified token with the drafts; with top-k 1 a draft model's steps are the drafts, and
    SGLang then sets num_draft_tokens to steps + 1 (its NGRAM ignores the steps)."""
    if num_draft_tokens is not None and not 2 <= num_draft_tokens <= MAX_DRAFT_TOKENS + 1:
        raise ValueError(
            "--speculative-num-draft-tokens counts the verified token with the drafts (as "
            f"SGLang's does): 2 to {MAX_DRAFT_TOKENS + 1}, got {num_draft_tokens}"
        )
    if num_steps is not None and not 1 <= num_steps <= MAX_DRAFT_TOKENS:
        raise ValueError(
            f"--speculative-num-steps must be 1 to {MAX_DRAFT_TOKENS}, got {num_steps}"
        )
    if method == "draft_model" and num_steps is not None:
        return num_steps
    if num_draft_tokens is not None:
        return num_draft_tokens - 1
    return DEFAULT_DRAFT_TOKENS


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
        raise ValueError(
            f"{flag}: unsupported key(s) {', '.join(unknown)}; tokenpipe reads "
            f"{', '.join(sorted(_VLLM_KEYS))}"
        )
    model = spec.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"{flag}: 'model' must be a string (the draft checkpoint's directory)")
    method = spec.get("method")
    if method is None:  # as vLLM: a model names the method, "ngram" or a draft checkpoint
        method = "ngram" if model in _VLLM_NGRAM else "draft_model" if model else None
    if not isinstance(method, str):
        raise ValueError(f"{flag}: give 'method' ('ngram' or 'draft_model'), or a draft 'model'")
    if _needs_trained_heads(method):
        raise _eagle_refusal(method, flag)
    served = _VLLM_METHODS.get(method)
    if served is None:
        raise ValueError(f"{flag}: method {method!r} is not one of 'ngram', 'draft_model'")
    k = _json_int(spec, "num_speculative_tokens", flag)
    if k is None or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(
            f"{flag}: 'num_speculative_tokens' must be an integer from 1 to {MAX_DRAFT_TOKENS}"
        )
    # vLLM: either bound alone sets both; neither is 5 and 5.
    low = _json_int(spec, "prompt_lookup_min", flag)
    high = _json_int(spec, "prompt_lookup_max", flag)
    low = low if low is not None else high if high is not None else VLLM_PROMPT_LOOKUP
    high = high if high is not None else low
    if not 1 <= low <= high:
        raise ValueError(
            f"{flag}: prompt_lookup_min and prompt_lookup_max need 1 <= min <= max, got {low} "
            f"and {high}"
        )
    by_size = _by_size(
        _json_int(spec, "disable_by_batch_size", flag), f"{flag}: disable_by_batch_size"
    )
    if by_size is not None and disable_by_batch_size is not None:
        raise ValueError(
            f"{flag}: give disable_by_batch_size in the JSON or --speculative-disable-by-batch-"
            "size, not both"
        )
    if served == "ngram" and model in _VLLM_NGRAM:
        model = None  # vLLM's own spelling of the n-gram method, not a checkpoint
    by_size = by_size if by_size is not None else disable_by_batch_size
    return _checked(served, k, low, high, (model, f"{flag}: 'model'"), by_size)


def _json_int(spec: dict[str, Any], key: str, flag: str) -> int | None:
    value = spec.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{flag}: {key!r} must be an integer, got {value!r}")
    return value


def _by_size(value: int | None, name: str) -> int | None:
    if value is not None and value < 0:
        raise ValueError(
            f"{name} must be 0 (no limit) or the batch size above which a step drafts nothing, "
            f"got {value}"
        )
    return value


def _checked(
    method: Method,
    k: int,
    low: int,
    high: int,
    model: tuple[str | None, str],  # the draft checkpoint, and the flag that names it
    disable_by_batch_size: int | None,
) -> SpeculativeConfig:
    path, model_flag = model
    if method == "draft_model" and not path:
        raise ValueError(f"{model_flag}: a draft model needs its checkpoint directory")
    if method == "ngram" and path:
        raise ValueError(f"{model_flag}: n-gram speculation takes no draft model")
    by_size = (
        DEFAULT_DISABLE_BY_BATCH_SIZE if disable_by_batch_size is None else disable_by_batch_size
    )
    return SpeculativeConfig(method, k, low, high, path, by_size)
