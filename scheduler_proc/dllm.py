"""Block diffusion decoding (``--mode dllm``, docs/design.md section 4).

A dLLM request prefills its prompt like any other (chunked, from the prefix cache), then
decodes block by block instead of token by token:

- A block is ``block_size`` (B) positions right after the request's tokens, all starting as
  the mask token. The mask is the tokenizer's EOS id (``<|endoftext|>``, id 0, for the
  shipped tokenizer): the built-in model has no dedicated mask token, so the EOS embedding
  stands in for "not unmasked yet". A model with a real mask token would set it here.
- Each scheduler step runs one refinement pass: ONE batched forward over every running dLLM
  request, each with its prefix KV from the pool, its last committed token (the anchor) and
  its block's B positions, which attend to the whole prefix and to each other both ways
  (``ForwardBatch.bidirectional_from``). As in diffusion models adapted from a causal LM
  (Dream), the logits at position i predict token i + 1: the anchor's predict the block's
  first position, block position j's predict position j + 1. So block size 1 with one step
  is exactly greedy/sampled autoregressive decoding, which a test pins. Logits are taken
  only at the rows that predict still-masked positions (``ModelRunner.logits_at``).
- Unmasking: a candidate token per masked position by the sampler's rules (``sample``:
  argmax at temperature 0; otherwise bias, penalties, temperature and cuts, then a draw
  whose counter is ``draw_counter(len(output_ids) + position, pass)``, so a seeded request
  is reproducible whatever it is batched with, and a restarted block draws the same numbers
  again; an output index below min_new_tokens draws no stop token or EOS, as in generate
  mode). Its confidence is the model's softmax probability of that token. Pass p of
  ``steps`` (S) commits the ``B // S + (p < B % S)`` most confident masked positions (ties
  go to the earlier position); the last pass commits all that remain.
- After the S-th pass the block is committed: its tokens are appended one by one through
  ``StopChecker`` (so EOS, stop tokens and stop strings cut the block right after the match,
  and max_new_tokens truncates the last block) and the block becomes one output row.

KV invariant: the pool holds for committed tokens the *causal* KV that a prefill of the same
tokens computes (up to float rounding, as a decode step's KV is). The block's B slots are
rewritten by every pass, and after the last pass they hold the keys of the tokens as they
were before its unmasking, so they are freed at commit; the next block's first pass
recomputes the committed tokens causally (they ride in front of the new masks in the same
forward: "recompute when the next block starts", no extra pass) and only then are they part
of ``Req.kv_slots``. The anchor is rewritten by every pass with the causal KV it already
had (it never attends to the block). Hence a retraction's re-prefill, a prefix-cache hit and
the block path give the same keys, and a retracted request simply re-prefills prompt +
committed tokens and restarts its block. A block's slots never enter the prefix cache.

Stats: after a block is committed and the request goes on, ``cached_tokens`` (and its
device count) is set through ``Req.update_stats`` to prompt + committed tokens: the prefix
whose KV the next block's passes reuse rather than run again with the block (the block just
committed gets its final KV from the next block's first pass; the rest is already in the
pool). The epoch bump
makes the block's row carry the new value. The last block changes nothing (no block
follows); its row carries stats because it is finished.

Rows: a streaming request emits one row per committed block (the block is the unit of
streaming, whatever the stream interval); a non-streaming one emits only its finished row.

Logprobs (docs/design.md section 11): a committed token's are those of the pass that committed it,
the raw log-softmax of that pass's logits at its position (before bias, penalties,
temperature and cuts; the confidence that chose it is not part of them). Each pass computes
them in one batched ``span_logprobs`` over the positions it commits of the requests that
asked (nothing when none asked), and the block keeps them by position
(``BlockLogprobs``); at commit those of the appended tokens, in output order, join the
request's pending logprobs, so the block's row carries one entry per token. A block that is
dropped (retraction) drops its logprobs with it: its tokens were never sent, and the
restarted block computes them again. Prompt logprobs come from the prefill, as in generate
mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.io_struct import CachedTokensDetails
from scheduler_proc.dllm_block import Block, BlockLogprobs
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.req import Req
from scheduler_proc.sampling.sampler import SamplingColumns, draw_counter
from scheduler_proc.sampling.logprobs import span_logprobs
from scheduler_proc.stop_checker import StopChecker


@dataclass(frozen=True)
class DllmConfig:
    block_size: int
    steps: int
    mask_token_id: int


class DllmDecoder:
    def __init__(
        self,
        config: DllmConfig,
        runner: ModelRunner,
        stop_checker: StopChecker,
        context_length: int,
        alloc: Callable[[int], torch.Tensor | None],
    ) -> None:
        self.config = config
        self.runner = runner
        self.stop_checker = stop_checker
        self.context_length = context_length
        self._alloc = alloc

    # --- KV accounting -------------------------------------------------------------------

    def peak_output_slots(self, max_new_tokens: int) -> int:
        """KV slots the output may take at its peak: the last block is whole even when
        the output stops short of it."""
        b = self.config.block_size
        return -(-max_new_tokens // b) * b

    def slots_needed(self, req: Req) -> int:
        """New pool slots the request's next pass takes: at a block's start the committed
        tokens to recompute plus the block; none while a block is in progress."""
        if req.dllm_block is not None:
            return 0
        return req.seq_len - req.num_computed + self._block_size(req)

    def drop_block(self, req: Req) -> None:
        """Drops the block in progress (retraction: it restarts later, drawing what it drew
        before, as the draws' counters depend on the output length and the pass only;
        finish; abort)."""
        if req.dllm_block is not None:
            self._free(req)

    def _free(self, req: Req) -> None:
        self.runner.kv.free(_block_of(req).slots)
        req.dllm_block = None

    def _block_size(self, req: Req) -> int:
        # Only at the end of the context is a block shorter: its positions must exist.
        return min(self.config.block_size, self.context_length - req.seq_len)

    # --- one refinement pass -------------------------------------------------------------

    def step(self, reqs: Sequence[Req], rows: list[Req]) -> tuple[list[Req], int]:
        """One batched pass over ``reqs`` (every running request; the caller has made room
        for ``slots_needed`` of each). Queues due rows; returns the requests that keep
        running and the number of tokens committed."""
        new_ids: list[list[int]] = []
        prefixes: list[torch.Tensor] = []
        new_slots: list[torch.Tensor] = []
        block_start: list[int] = []
        fresh_slots: list[
            torch.Tensor | None
        ] = []  # per request: slots of committed tokens recomputed
        masked: list[list[int]] = []  # per request: its masked block positions
        rows_of_masked: list[int] = []  # the rows predicting them among the pass's new tokens, flat
        owners: list[Req] = []  # and their requests
        out_lens: list[int] = []  # and their output indices
        counters: list[np.uint64] = []  # and their draws' counters
        offset = 0
        for req in reqs:
            kv_slots = req.kv_slots
            assert kv_slots is not None
            block, fresh = req.dllm_block, None
            if block is None:
                # A block starts: committed tokens without final KV are recomputed in front.
                size, stale = self._block_size(req), req.seq_len - req.num_computed
                slots = self._alloc(stale + size)
                assert slots is not None, "the scheduler made room for every block"
                fresh = slots[:stale]
                block = req.dllm_block = Block(
                    size, self.config.mask_token_id, slots[stale:], req.logprob
                )
            # The head: tokens before the block that this pass writes. At least the anchor
            # (the last committed token, rewritten with the causal KV it already had), as
            # its hidden state predicts the block's first position.
            start = min(req.num_computed, req.seq_len - 1)
            head = _tokens_from(req, start)
            head_slots = kv_slots[start:] if fresh is None else torch.cat((kv_slots[start:], fresh))
            new_ids.append(head + block.tokens)
            prefixes.append(kv_slots[:start])
            new_slots.append(torch.cat((head_slots, block.slots)))
            block_start.append(req.seq_len)
            fresh_slots.append(fresh)
            positions = block.masked_positions()
            masked.append(positions)
            anchor_row = offset + len(head) - 1
            rows_of_masked.extend(anchor_row + j for j in positions)
            owners.extend([req] * len(positions))
            emitted = len(req.output_ids)
            out_lens.extend(emitted + j for j in positions)
            counters.extend(draw_counter(emitted + j, block.passes) for j in positions)
            offset += len(head) + len(block.tokens)

        logits = self.runner.logits_at(
            new_ids,
            prefixes,
            new_slots,
            torch.tensor(rows_of_masked, dtype=torch.long),
            block_start,
        )
        params = [r.sampling for r in owners]
        cols = SamplingColumns.from_requests(
            params,
            [r.seed for r in owners],
            counters,
            [r.origin_input_ids for r in owners],
            [r.output_ids for r in owners],
            logits.shape[-1],
            logits.device,
            self.stop_checker.min_new_bans_of(params, out_lens),
        )
        drawn = self.runner.sample(logits, cols)
        picked = torch.from_numpy(drawn).to(logits.device).unsqueeze(1)
        confidence = torch.softmax(logits, dim=-1).gather(1, picked).squeeze(1).tolist()
        candidates = drawn.tolist()

        lp_rows: list[
            int
        ] = []  # rows of ``logits`` whose positions this pass commits, of requests that asked
        lp_where: list[
            tuple[BlockLogprobs, list[int]]
        ] = []  # per such request: those positions, in that order
        first = 0
        for req, fresh, positions in zip(reqs, fresh_slots, masked):
            if (
                fresh is not None and fresh.numel()
            ):  # their KV is final now: they join the request's KV
                held = req.kv_slots
                assert held is not None
                req.kv_slots = torch.cat((held, fresh))
                req.num_computed += fresh.numel()
            last = first + len(positions)
            block = _block_of(req)
            chosen = self._unmask(block, positions, candidates[first:last], confidence[first:last])
            if block.logprobs is not None and chosen:
                lp_rows.extend(first + i for i in chosen)
                lp_where.append((block.logprobs, [positions[i] for i in chosen]))
            first = last
        if lp_rows:
            index = np.array(lp_rows, dtype=np.int64)
            spans = [(kept.ask, len(where)) for kept, where in lp_where]
            for (kept, where), part in zip(
                lp_where, span_logprobs(logits, index, drawn[index], spans)
            ):
                kept.keep(where, part)

        still_running: list[Req] = []
        committed = 0
        for req in reqs:
            if _block_of(req).passes < self.config.steps:
                still_running.append(req)
                continue
            committed += self._commit(req, rows)
            if not req.finished:
                still_running.append(req)
        return still_running, committed

    def _unmask(
        self, block: Block, positions: list[int], candidates: list[int], confidence: list[float]
    ) -> list[int]:
        """Commits this pass's share of the masked positions: the most confident ones
        (ties to the earlier position), and all that remain on the last pass. Returns the
        indices into ``positions`` it committed."""
        steps, p, size = self.config.steps, block.passes, len(block.tokens)
        take = size // steps + (p < size % steps) if p < steps - 1 else size
        best = sorted(range(len(positions)), key=lambda i: (-confidence[i], positions[i]))[:take]
        for i in best:
            block.tokens[positions[i]] = candidates[i]
            block.masked[positions[i]] = False
        block.passes += 1
        return best

    def _commit(self, req: Req, rows: list[Req]) -> int:
        """Appends the block's tokens through the stop checks, queues the row, frees the
        block's slots; returns the number of tokens appended."""
        block = _block_of(req)
        tokens = block.tokens
        self._free(req)
        appended = 0
        for token in tokens:
            req.output_ids.append(token)
            appended += 1
            reason = self.stop_checker.check(req)
            if reason is not None:
                req.finish(reason)
                break
        if block.logprobs is not None:
            req.pending_logprobs.append(block.logprobs.first(appended))
        if not req.finished:
            cached = req.seq_len
            req.update_stats(
                cached_tokens=cached,
                cached_tokens_details=CachedTokensDetails(device=cached, host=0),
            )
        if req.finished or req.stream:
            rows.append(req)
        return appended


def _tokens_from(req: Req, start: int) -> list[int]:
    """``req.fill_ids[start:]`` without building the whole list."""
    prompt = req.origin_input_ids
    if start >= len(prompt):
        return req.output_ids[start - len(prompt) :]
    return prompt[start:] + req.output_ids


def _block_of(req: Req) -> Block:
    """The block ``req`` refines: every running request holds one from its pass on."""
    block = req.dllm_block
    assert block is not None, f"{req!r} refines no block"
    return block
