"""Embedding requests (``TokenizedEmbeddingReqInput``): the prompt's final hidden states,
summed chunk by chunk during prefill and mean-pooled, L2-normalised, when it completes."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.io_struct import BatchEmbeddingOutput
from scheduler_proc.output_builder import build_embedding_output
from scheduler_proc.req import Req


def accumulate_hidden(
    batch: list[tuple[Req, list[int], torch.Tensor]], hidden: torch.Tensor
) -> None:
    """Adds each embedding request's new hidden states into its running sum, so a
    prompt prefilled in chunks pools exactly like one prefilled at once."""
    offset = 0
    for req, toks, _ in batch:
        if req.is_embedding:
            part = hidden[offset : offset + len(toks)].sum(dim=0, dtype=torch.float32)
            req.hidden_sum = part if req.hidden_sum is None else req.hidden_sum + part
        offset += len(toks)


def pooled_embedding(req: Req, hidden_size: int) -> np.ndarray:
    """Mean over the prompt's final hidden states, L2-normalised; zeros for a request
    that ended before its prefill did (an abort)."""
    if req.hidden_sum is None or req.num_computed < len(req.origin_input_ids):
        return np.zeros(hidden_size, dtype=np.float32)
    mean = req.hidden_sum / len(req.origin_input_ids)
    return torch.nn.functional.normalize(mean, dim=0).cpu().numpy().astype(np.float32)


def embedding_frame(embedded: list[Req], hidden_size: int) -> BatchEmbeddingOutput:
    """The frame of these finished embedding requests: each one's pooled embedding."""
    pooled = np.stack([pooled_embedding(r, hidden_size) for r in embedded])
    return build_embedding_output(embedded, pooled)
