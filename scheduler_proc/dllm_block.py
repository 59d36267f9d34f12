"""The block a dLLM request is refining (``Req.dllm_block``), and its committed positions'
logprobs. A request holds its block, and ``dllm.DllmDecoder`` refines it: both import this
module, which imports neither (docs/design/scheduler.md describes the decoding)."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.io_struct import LogprobParams
from pipeline.logprob_columns import LOGPROB_DTYPE, LOGPROB_ID_DTYPE, TokenLogprobs


class BlockLogprobs:
    """The logprobs of a block's committed positions, by position (rows of positions still
    masked are not yet meaningful), as the pass that committed each computed them."""

    __slots__ = ("ask", "values")

    def __init__(self, size: int, ask: LogprobParams) -> None:
        self.ask = ask
        k, m = ask.top_logprobs_num, len(ask.token_ids_logprob)
        self.values = TokenLogprobs(
            np.zeros(size, dtype=LOGPROB_DTYPE),
            np.zeros((size, k), dtype=LOGPROB_ID_DTYPE),
            np.zeros((size, k), dtype=LOGPROB_DTYPE),
            np.zeros((size, m), dtype=LOGPROB_DTYPE),
        )

    def keep(self, positions: list[int], part: TokenLogprobs) -> None:
        """``part``: one entry per position of ``positions``, in that order."""
        v = self.values
        v.chosen[positions] = part.chosen
        v.top_ids[positions] = part.top_ids
        v.top_values[positions] = part.top_values
        v.ids_values[positions] = part.ids_values

    def first(self, n: int) -> TokenLogprobs:
        """Those of the first ``n`` positions (the tokens a commit appended)."""
        v = self.values
        return TokenLogprobs(v.chosen[:n], v.top_ids[:n], v.top_values[:n], v.ids_values[:n])


class Block:
    """The block a request is refining: its tokens (the mask token where still masked),
    which positions are still masked (a committed token may equal the mask id), the pool
    slots its positions are written to, passes done, and the committed positions' logprobs
    when the request asked."""

    __slots__ = ("logprobs", "masked", "passes", "slots", "tokens")

    def __init__(
        self, size: int, mask_token_id: int, slots: torch.Tensor, ask: LogprobParams | None
    ) -> None:
        self.tokens = [mask_token_id] * size
        self.masked = [True] * size
        self.slots = slots
        self.passes = 0
        self.logprobs = None if ask is None else BlockLogprobs(size, ask)

    def masked_positions(self) -> list[int]:
        return [j for j, m in enumerate(self.masked) if m]
