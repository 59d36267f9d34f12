"""Field types and ranges that the request bodies of every dialect share (native, OpenAI
chat and completions, Responses), and ``logit_bias_pairs``, which makes the wire's pairs of a
``logit_bias`` map. Null is the neutral value of the optional sampling fields (0, or 1 for
``repetition_penalty``)."""

from __future__ import annotations

import re
from typing import Annotated

from msgspec import Meta

from pipeline.request_limits import MAX_STOP_TOKEN_IDS
from tokenizer_proc.request_edge.errors import RequestValidationError

NonNegInt = Annotated[int, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]
# vLLM refuses an empty salt: it would look like a salt and share the unsalted cache.
CacheSalt = Annotated[str, Meta(min_length=1, max_length=4096)]
Priority = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]

# The sampling parameters of docs/design.md section 10 beyond temperature/top_p/top_k, with
# the ranges all three APIs share.
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # OpenAI's frequency and presence range
# SGLang allows [0, 2], vLLM anything above 0: a positive logit is divided by it, so not 0.
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
MAX_TOP_LOGPROBS = 20  # top_logprobs_num, as OpenAI's top_logprobs
MAX_TOKEN_IDS_LOGPROB = 128  # token_ids_logprob entries: each costs a float per token on the wire
MAX_LOGIT_BIAS = 1024
"""Entries of one request's ``logit_bias``: vLLM v1's limit (OpenAI documents none)."""
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# Token id -> bias, the id written as a string (JSON object keys are strings). The keys and
# values are checked by ``logit_bias_pairs`` so that the message can name the bad entry; the
# ids against the vocabulary by ``RequestChecks.validate_sampling``.
LogitBias = Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)]
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,18}")
# Bounded as logit_bias is: every running request shares one stop table as wide as the
# widest request's list, so one long list would slow every stop check of the batch.
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]


def logit_bias_pairs(bias: dict[str, float] | None, param: str) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as the wire carries it: (token id, bias) pairs sorted by id. ``param``
    is the field's path in the body, for the messages."""
    if not bias:
        return ()
    low, high = LOGIT_BIAS_RANGE
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        if _TOKEN_ID_KEY.fullmatch(key) is None:
            raise RequestValidationError(
                f"{param} key {key[:40]!r} is not a token id: keys are non-negative integers "
                "written as strings",
                param,
            )
        if not low <= value <= high:
            raise RequestValidationError(
                f"{param}[{key!r}] is {value}; a bias must be in [{low:g}, {high:g}]", param
            )
        token = int(key)
        if token in pairs:  # "7" and "007"
            raise RequestValidationError(f"{param} names token id {token} twice", param)
        pairs[token] = value
    return tuple(sorted(pairs.items()))
