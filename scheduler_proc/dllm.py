"""Block diffusion decoding (``--mode dllm``, docs/design/scheduler.md). A request prefills
like any other, then decodes block by block: a block is ``block_size`` positions after its
tokens, all starting as the mask token; each step runs one refinement pass over every running
request (one batched forward in which the block attends both ways), unmasks the most
confident positions, and after ``steps`` passes commits the block as one row.

KV invariant: the pool holds for committed tokens the *causal* KV a prefill of the same tokens
computes. A block's slots are rewritten by every pass and freed at commit; the next block's
first pass recomputes the committed tokens causally in front of its masks, and only then are
they in ``Req.kv_slots``. Hence a re-prefill after a retraction, a prefix-cache hit and the
block path give the same keys, a retracted request re-prefills its prompt and committed
tokens and restarts its block, and a block's slots never enter the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.io_struct import CachedTokensDetails
from scheduler_proc.dllm_block import Block, BlockLogprobs
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.output_builder import SteadyRows
from scheduler_proc.req import Req
from scheduler_proc.sampling.sampler import SamplingColumns, draw_counter
from scheduler_proc.sampling.logprobs import span_logprobs
from scheduler_proc.speculative.counters import SpecCounters
from scheduler_proc.stop_checker import StopChecker


@dataclass(frozen=True)
class DllmConfig:
    """The mask token is a stand-in for "not unmasked yet": the built-in model has none of its
    own, so ``scheduler_proc.main.dllm_config`` takes the lowest EOS id (``<|endoftext|>``);
    a model with a real mask token would set it here."""

    block_size: int
    steps: int
    mask_token_id: int


@dataclass
class _Pass:
    """One refinement pass being built: per request its new tokens (the head, then the
    block), its prefix's and new tokens' slots, where its block starts, and the slots of
    committed tokens it recomputes; flat over the masked positions of all blocks, the row
    of ``logits_at`` that predicts each, its request, output index and draw counter."""

    new_ids: list[list[int]] = field(default_factory=list)
    prefixes: list[torch.Tensor] = field(default_factory=list)
    new_slots: list[torch.Tensor] = field(default_factory=list)
    block_start: list[int] = field(default_factory=list)
    fresh_slots: list[torch.Tensor | None] = field(default_factory=list)
    masked: list[list[int]] = field(default_factory=list)
    rows_of_masked: list[int] = field(default_factory=list)
    owners: list[Req] = field(default_factory=list)
    out_lens: list[int] = field(default_factory=list)
    counters: list[np.uint64] = field(default_factory=list)
    offset: int = 0


class DllmDecoder:
    """The scheduler's ``DecodeMode`` in ``--mode dllm``: its running requests are a list,
    each refining the block it holds (``Req.dllm_block``)."""

    samples_first_token = False  # the first block's passes pick the first tokens
    output_slots_note = " in whole blocks"
    # A pass commits positions of a block out of order; a grammar reads left to right.
    constraint_refusal: str | None = "structured outputs are not supported in --mode dllm"
    # Forcing a reasoning's end reads the output left to right too.
    thinking_budget_refusal: str | None = "thinking_budget is not supported in --mode dllm"

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
        self._running: list[Req] = []
        self.spec_counters = SpecCounters(0)  # a dLLM server does not speculate

    @property
    def running(self) -> list[Req]:
        return self._running

    def note_sent(self, req: Req) -> None:
        pass  # a block's row carries all it has

    # --- KV accounting -------------------------------------------------------------------

    def peak_output_slots(self, max_new_tokens: int) -> int:
        """KV slots the output may take at its peak: the last block is whole even when
        the output stops short of it."""
        b = self.config.block_size
        return -(-max_new_tokens // b) * b

    def demand(self) -> int:
        return sum(self.slots_needed(r) for r in self._running)

    def slots_needed(self, req: Req) -> int:
        """New pool slots the request's next pass takes: at a block's start the committed
        tokens to recompute plus the block; none while a block is in progress."""
        if req.dllm_block is not None:
            return 0
        return req.seq_len - req.num_computed + self._block_size(req)

    def drop_block(self, req: Req) -> None:
        """Drops the block in progress (retraction: it restarts later, drawing what it drew
        before, as the draws' counters depend on the output length and the pass only;
        finish; abort). A dropped block's logprobs go with it: its tokens were never sent."""
        if req.dllm_block is not None:
            self._free(req)

    def _free(self, req: Req) -> None:
        self.runner.kv.free(_block_of(req).slots)
        req.dllm_block = None

    def _block_size(self, req: Req) -> int:
        # Only at the end of the context is a block shorter: its positions must exist.
        return min(self.config.block_size, self.context_length - req.seq_len)

    # --- one refinement pass -------------------------------------------------------------

    def start(self) -> None:
        pass  # a block's passes depend on each other: each runs in ``step``

    def step(self, rows: list[Req]) -> tuple[SteadyRows | None, int]:
        """One batched pass over every running request (the caller has made room for
        ``slots_needed`` of each). Queues due rows, keeps running the requests that go on;
        returns no steady rows and the number of tokens committed."""
        built = _Pass()
        for req in self._running:
            self._add_to_pass(built, req)
        logits = self.runner.logits_at(
            built.new_ids,
            built.prefixes,
            built.new_slots,
            torch.tensor(built.rows_of_masked, dtype=torch.long),
            built.block_start,
        )
        drawn, confidence = self._draw(logits, built)
        self._unmask_all(built, logits, drawn, confidence)
        return None, self._commit_completed(rows)

    def _unmask_all(
        self, built: _Pass, logits: torch.Tensor, drawn: np.ndarray, confidence: list[float]
    ) -> None:
        """Each block takes this pass's share of its candidates; the committed tokens a block
        start recomputed join their request's KV (final now), and the committed positions'
        logprobs are kept on the blocks of the requests that asked."""
        candidates = drawn.tolist()
        lp_rows: list[int] = []  # rows of ``logits`` committed now, of requests that asked
        lp_where: list[tuple[BlockLogprobs, list[int]]] = []  # and their positions, by request
        first = 0
        for req, fresh, positions in zip(self._running, built.fresh_slots, built.masked):
            if fresh is not None and fresh.numel():
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
            _keep_logprobs(logits, drawn, lp_rows, lp_where)

    def _add_to_pass(self, built: _Pass, req: Req) -> None:
        """Adds ``req`` to the pass, starting its block when it has none. Its head (the
        tokens before the block that the pass writes) is at least the anchor, the last
        committed token, rewritten with the causal KV it already had (it never attends to
        the block). As in diffusion models adapted from a causal LM (Dream), the logits at
        position i predict token i + 1: the anchor's predict the block's first position, so
        a block of one position and one pass is exactly autoregressive decoding."""
        kv_slots = req.kv_slots
        assert kv_slots is not None
        block, fresh = req.dllm_block, None
        if block is None:
            # A block starts: committed tokens without final KV are recomputed in front.
            size, stale = self._block_size(req), req.seq_len - req.num_computed
            slots = self._alloc(stale + size)
            assert slots is not None, "the scheduler made room for every block"
            fresh = slots[:stale]
            mask = self.config.mask_token_id
            block = req.dllm_block = Block(size, mask, slots[stale:], req.logprob)
        start = min(req.num_computed, req.seq_len - 1)
        head = _tokens_from(req, start)
        head_slots = kv_slots[start:] if fresh is None else torch.cat((kv_slots[start:], fresh))
        built.new_ids.append(head + block.tokens)
        built.prefixes.append(kv_slots[:start])
        built.new_slots.append(torch.cat((head_slots, block.slots)))
        built.block_start.append(req.seq_len)
        built.fresh_slots.append(fresh)
        positions = block.masked_positions()
        built.masked.append(positions)
        anchor_row = built.offset + len(head) - 1
        built.rows_of_masked.extend(anchor_row + j for j in positions)
        built.owners.extend([req] * len(positions))
        emitted = len(req.output_ids)
        built.out_lens.extend(emitted + j for j in positions)
        built.counters.extend(draw_counter(emitted + j, block.passes) for j in positions)
        built.offset += len(head) + len(block.tokens)

    def _draw(self, logits: torch.Tensor, built: _Pass) -> tuple[np.ndarray, list[float]]:
        """A candidate token per masked position by the sampler's rules (argmax at
        temperature 0; otherwise bias, penalties, temperature and cuts, then a draw whose
        counter is ``draw_counter(len(output_ids) + position, pass)``, so a seeded request is
        reproducible whatever it is batched with, and a restarted block draws the same numbers
        again; an output index below min_new_tokens draws no stop token or EOS), and its
        confidence: the model's softmax probability of that token."""
        owners = built.owners
        params = [r.sampling for r in owners]
        cols = SamplingColumns.from_requests(
            params,
            [r.seed for r in owners],
            built.counters,
            [r.origin_input_ids for r in owners],
            [r.output_ids for r in owners],
            logits.shape[-1],
            logits.device,
            self.stop_checker.min_new_bans_of(params, built.out_lens),
        )
        drawn = self.runner.sample(logits, cols)
        picked = torch.from_numpy(drawn).to(logits.device).unsqueeze(1)
        confidence = torch.softmax(logits, dim=-1).gather(1, picked).squeeze(1).tolist()
        return drawn, confidence

    def _unmask(
        self, block: Block, positions: list[int], candidates: list[int], confidence: list[float]
    ) -> list[int]:
        """Commits this pass's share of the masked positions: pass p of ``steps`` (S) takes
        the ``B // S + (p < B % S)`` most confident (ties to the earlier position), and the
        last pass all that remain. Returns the indices into ``positions`` it committed."""
        steps, p, size = self.config.steps, block.passes, len(block.tokens)
        take = size // steps + (p < size % steps) if p < steps - 1 else size
        best = sorted(range(len(positions)), key=lambda i: (-confidence[i], positions[i]))[:take]
        for i in best:
            block.tokens[positions[i]] = candidates[i]
            block.masked[positions[i]] = False
        block.passes += 1
        return best

    def _commit_completed(self, rows: list[Req]) -> int:
        """Commits the blocks that had their last pass; the running list keeps the requests
        that go on. Returns the number of tokens committed."""
        still_running: list[Req] = []
        committed = 0
        for req in self._running:
            if _block_of(req).passes < self.config.steps:
                still_running.append(req)
                continue
            committed += self._commit(req, rows)
            if not req.finished:
                still_running.append(req)
        self._running[:] = still_running
        return committed

    def _commit(self, req: Req, rows: list[Req]) -> int:
        """Appends the block's tokens through the stop checks (EOS, stop tokens and stop
        strings cut the block right after the match; max_new_tokens truncates the last
        block), frees the block's slots and queues its row; returns the tokens appended.

        A streaming request emits one row per block, whatever the stream interval. When the
        request goes on, ``cached_tokens`` becomes prompt + committed tokens (the prefix the
        next block's passes reuse), through the stats setter, so the block's row carries it.
        """
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


def _keep_logprobs(
    logits: torch.Tensor,
    drawn: np.ndarray,
    lp_rows: list[int],
    lp_where: list[tuple[BlockLogprobs, list[int]]],
) -> None:
    """A committed token's logprobs (docs/design/logprobs.md) are the raw log-softmax of
    the logits of the pass that committed it (not the confidence that chose it): one batched
    ``span_logprobs`` over those positions, kept on each block by position until its commit
    hands those of the appended tokens to the request's pending logprobs."""
    index = np.array(lp_rows, dtype=np.int64)
    spans = [(kept.ask, len(where)) for kept, where in lp_where]
    for (kept, where), part in zip(lp_where, span_logprobs(logits, index, drawn[index], spans)):
        kept.keep(where, part)


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
