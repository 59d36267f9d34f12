"""What ``Req.pd`` holds: a request's part in PD disaggregation, one type per part.

- ``PrefillHalf`` (prefill server): a client request with a bootstrap room; its KV goes to
  the decode server's fetch for the same room when it is released.
- ``KVFetchJob`` (prefill server): an internal request that computes the KV a decode
  server asks for again after a retraction (a re-bootstrap); it emits no row.
- ``DecodeBootstrap`` (decode server): a request whose KV comes from a prefill server
  ("prebuilt"), never from a prefill here.
- None: a request outside PD (a unified server's, or one sent without a bootstrap room).
Plain data beside ``req.py``, which holds it: ``scheduler_proc.pd.prefill`` and
``scheduler_proc.pd.decode`` act on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.io_struct import FrameLogprobs, KVFetch, KVTransferHeader
from pipeline.logprob_columns import TokenLogprobs


@dataclass
class PrefillHalf:
    room: int
    # Its first token's and its prompt's logprobs, for the KV header (keep_first_logprobs).
    logprobs: FrameLogprobs | None = None


@dataclass
class KVFetchJob:
    identity: bytes  # the decode server's connection, which the KV goes back to
    fetch: KVFetch


@dataclass
class Prebuilt:
    """A transfer that arrived: the KV of the request's tokens but the last."""

    header: KVTransferHeader
    k: torch.Tensor
    v: torch.Tensor
    received_time: float
    # The first transfer of a request that asked: its first token's and prompt's logprobs.
    first_logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None


@dataclass
class DecodeBootstrap:
    room: int
    endpoint: str
    attempt: int = -1
    deadline: float = 0.0
    sent_time: float = 0.0  # when the current fetch went out
    prebuilt: Prebuilt | None = None


PdState = PrefillHalf | KVFetchJob | DecodeBootstrap | None
