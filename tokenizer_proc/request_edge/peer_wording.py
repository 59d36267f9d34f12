"""The words vLLM's and SGLang's users match on, for the refusals the two peers word
differently: a prompt longer than the context, a max_tokens too large for it, token ids outside
the vocabulary, a nested list where a flat list of ints is expected, a seed out of range.

One rule (docs/api.md, "Errors in the peers' words"): such a refusal's message is the route's
own peer's phrase (SGLang's on /generate, vLLM's on the OpenAI routes), then the other peer's,
then tokenpipe's detail, which alone names the request's fields. A ``PeerWordedError`` keeps
the three apart, so a route that renames fields renames the detail and never a phrase a client
matches. The status is the peers' 400. A ``PeerPhrases`` entry is None where that peer does
not refuse the request at all (SGLang takes any stop token id and any seed).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from tokenizer_proc.request_edge.errors import RequestValidationError

__all__ = [
    "Peer",
    "PeerPhrases",
    "PeerWordedError",
    "context_overflow",
    "decode_message",
    "max_tokens_over_limit",
    "out_of_vocabulary",
]

Peer = Literal["sglang", "vllm"]
"""Whose words lead: SGLang's on the native routes, vLLM's on the OpenAI-style ones."""

_LISTED_IDS = 8  # the offending ids a message lists: a long prompt may hold many


@dataclass(frozen=True, slots=True)
class PeerPhrases:
    """One refusal in each peer's words (None: that peer does not refuse it)."""

    sglang: str | None
    vllm: str | None

    def led_by(self, lead: Peer) -> tuple[str, ...]:
        first, second = (self.sglang, self.vllm) if lead == "sglang" else (self.vllm, self.sglang)
        return tuple(phrase for phrase in (first, second) if phrase is not None)


class PeerWordedError(RequestValidationError):
    """A 400 whose message is ``phrases`` (``lead``'s first), then ``detail``."""

    def __init__(
        self, phrases: PeerPhrases, detail: str, param: str | None, lead: Peer = "sglang"
    ) -> None:
        self.phrases = phrases
        self.detail = detail
        self.lead: Peer = lead
        super().__init__(_sentences(*phrases.led_by(lead), detail), param)

    def reworded(
        self, lead: Peer, rename: Callable[[str], str], param: str | None
    ) -> PeerWordedError:
        """This refusal as another route words it: ``lead``'s phrase first, the detail's
        field names renamed (the phrases are the peers' own, never renamed)."""
        return PeerWordedError(self.phrases, rename(self.detail), param, lead)


def _sentences(*parts: str) -> str:
    """The parts as one message, each but the last ended as a sentence (vLLM's vocabulary
    phrase has no period); the last (the detail, msgspec's sentence) is left as it is."""
    ended = [p if p.endswith((".", ")")) else p + "." for p in parts[:-1]]
    return " ".join([*ended, parts[-1]])


def _listed(ids: Sequence[int]) -> str:
    unique = list(dict.fromkeys(ids))
    more = ", ..." if len(unique) > _LISTED_IDS else ""
    return "[" + ", ".join(map(str, unique[:_LISTED_IDS])) + more + "]"


def context_overflow(prompt_len: int, max_new_tokens: int, context_length: int) -> PeerPhrases:
    """A prompt that leaves no room in the context (``prompt_len >= context_length``, as both
    peers check it), else a prompt plus max_new_tokens beyond it. vLLM's words are those of
    its ``_validate_input`` (0.10.2 on), which clients parse for the room left
    (``M > C - N``); SGLang's those of its tokenizer manager's ``_validate_one_request``."""
    n, m, c = prompt_len, max_new_tokens, context_length
    if n >= c:
        return PeerPhrases(
            sglang=(
                f"The input ({n} tokens) is longer than the model's context length ({c} tokens)."
            ),
            vllm=(
                f"This model's maximum context length is {c} tokens. However, your request has "
                f"{n} input tokens. Please reduce the length of the input messages."
            ),
        )
    return PeerPhrases(
        sglang=(
            f"Requested token count exceeds the model's maximum context length of {c} tokens. "
            f"You requested a total of {n + m} tokens: {n} tokens from the input messages and "
            f"{m} tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit."
        ),
        vllm=(
            f"'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum "
            f"context length is {c} tokens and your request has {n} input tokens "
            f"({m} > {c} - {n})."
        ),
    )


def max_tokens_over_limit(max_new_tokens: int) -> PeerPhrases:
    """A max_new_tokens above ``--max-new-tokens-limit``: neither peer has such a limit, so
    vLLM's words for a max_tokens it refuses lead on every route."""
    return PeerPhrases(
        sglang=None, vllm=f"'max_tokens' or 'max_completion_tokens' is too large: {max_new_tokens}."
    )


def out_of_vocabulary(field: str, bad: Sequence[int], vocab_size: int) -> PeerPhrases:
    """Token ids of ``field`` (its native name) not below ``vocab_size``; ``bad``: those ids,
    in order. The prompt's (``input_ids``) are vLLM's input processor's and SGLang's
    tokenizer manager's words (listing the offending ids, not the whole prompt as SGLang
    does); the others are those of vLLM's ``SamplingParams.verify`` and SGLang's checks."""
    v, listed = vocab_size, _listed(bad)
    vllm_field = (
        f"token_id(s) {listed} in {field} contain out-of-vocab token ids. Vocabulary size: {v}"
    )
    if field == "input_ids":
        return PeerPhrases(
            sglang=f"The input_ids {listed} contains values greater than the vocab size ({v}).",
            vllm=f"Token id {max(bad)} is out of vocabulary",
        )
    if field == "logit_bias":
        return PeerPhrases(
            sglang=f"logit_bias must has keys in [0, {v - 1}], got {bad[0]}.", vllm=vllm_field
        )
    if field == "token_ids_logprob":  # vLLM names its field logprob_token_ids
        return PeerPhrases(
            sglang=(
                f"token_ids_logprob contains out-of-vocabulary token id {bad[0]}; valid range is "
                f"[0, {v})."
            ),
            vllm=vllm_field.replace("token_ids_logprob", "logprob_token_ids"),
        )
    return PeerPhrases(sglang=None, vllm=vllm_field)  # stop_token_ids: SGLang takes any


# msgspec's words for the two decode failures the peers word differently.
_NESTED = re.compile(r"Expected `int`, got `array` - at `\$\.(?P<list>.+)\[\d+\]`")
_SEED_BOUND = re.compile(
    r"Expected `int` (?P<op>[<>]=) (?P<bound>-?\d+) - at `\$\.(?:.+\.)?(?:sampling_)?seed`"
)


def decode_message(message: str, decoded: type) -> str:
    """msgspec's message for a body of type ``decoded`` that does not decode, with the
    peers' phrases in front when it is one they word: an array where a list's int is expected
    (SGLang's ``token_ids_logprob`` words, pydantic's on both peers' OpenAI routes) or a seed
    beyond its range (pydantic's; SGLang takes any seed). SGLang's words lead for a type that
    says so (``PEER_WORDING = "sglang"``: the native requests), vLLM's for the others.
    msgspec's sentence stays last: its ``- at `$.path``` names the field. Any other message is
    returned as it is."""
    nested = _NESTED.fullmatch(message)
    seed = _SEED_BOUND.fullmatch(message)
    if nested is not None:
        phrases = PeerPhrases(
            sglang=f"{nested['list']} must be a flat list of integers.",
            vllm="Input should be a valid integer",
        )
    elif seed is not None:
        side = "less" if seed["op"] == "<=" else "greater"
        phrases = PeerPhrases(
            sglang=None, vllm=f"Input should be {side} than or equal to {seed['bound']}"
        )
    else:
        return message
    lead: Peer = "sglang" if getattr(decoded, "PEER_WORDING", "vllm") == "sglang" else "vllm"
    return _sentences(*phrases.led_by(lead), message)
