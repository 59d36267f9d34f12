"""The speculative step (docs/design/speculative.md): a proposer drafts up to k tokens for
some running rows, one verify pass of the target computes the logits of every row's last
token and its drafts, and then each position is drawn as plain decoding would draw it:
position j of every row still going is one draw (``BatchDecoder.draw``) with the state that
row has after its tokens before j (bans, grammar, penalties, its counter), so the drawn
token is the one decoding without drafts would give. A row goes on to position j + 1 while
its draw equals its draft j and it has not stopped; its first differing draw is its last
token this step. The KV of its rejected drafts goes back to the pool before the step ends."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from scheduler_proc.batch.decode_pass import BatchDecoder
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.model.forward_batch import ForwardBatch, new_positions
from scheduler_proc.model.forward_worker import ForwardRunner
from scheduler_proc.output_builder import SteadyRows
from scheduler_proc.req import Req
from scheduler_proc.speculative.counters import SpecCounters
from scheduler_proc.speculative.proposer import Drafter
from scheduler_proc.stop_checker import RUNNING


@dataclass(frozen=True, slots=True)
class Plan:
    """One step's drafts, over the whole batch as it was when they were made."""

    changes: int  # the batch's ``changes`` then: rows may not have moved since
    proposed: np.ndarray  # the rows the proposer was asked about (ascending)
    counts: np.ndarray  # int64 [n]: each row's drafts (0 for most rows of a cold batch)
    drafts: np.ndarray  # int64 [n, k]: row r's drafts in its first counts[r] columns

    @property
    def num_drafts(self) -> int:
        return int(self.counts.sum())


# The step's cost model, in units of a decode step's fixed cost (measured on this CPU with
# bench/serve.py --compare-speculative's checkpoints at 1 and 16 rows; docs/design/
# speculative.md, "Adaptivity"): a decode step of n rows costs 1 + DECODE_ROW * n; a verify
# step costs VERIFY_STEP + VERIFY_ROW * n + VERIFY_DRAFT * d more for d draft tokens (its host
# work, the draws position by position and the proposals, and its pass's extra tokens).
DECODE_ROW = 0.18
VERIFY_STEP = 0.5
VERIFY_ROW = 0.25
VERIFY_DRAFT = 0.05
# Under --enable-deterministic-inference a verify pass attends query by query (a decode pass
# does not): about 0.2 more per row at 16 rows.
DETERMINISTIC_ROW = 0.2


def _pays(batch: RunningBatch, plan: Plan, verify_row: float) -> bool:
    """Whether the drafts should add more tokens than verifying them costs: n rows make
    ``n / (1 + DECODE_ROW * n)`` tokens per unit without drafts, and with them the tokens
    the drafts should add (each row's drafts times its acceptance so far, counted from two
    accepted drafts, so a row with none yet tries) over the verify step's cost."""
    n = len(batch)
    rows = plan.proposed
    accepted, drafted = batch.spec.accepted[rows], batch.spec.draft_tokens[rows]
    expected = float((plan.counts[rows] * (accepted + 2) / (drafted + 2)).sum())
    extra = VERIFY_STEP + verify_row * n + VERIFY_DRAFT * plan.num_drafts
    return expected * (1 + DECODE_ROW * n) > n * extra


class NoSpeculation:
    """Speculation off: every step is a plain decode step."""

    def __init__(self) -> None:
        self.counters = SpecCounters(0)

    def plan(self, batch: RunningBatch) -> Plan | None:
        return None

    # Never called: ``plan`` gives no drafts to launch, cancel or finish.
    def launch(self, batch: RunningBatch, plan: Plan, slots: torch.Tensor) -> Future[torch.Tensor]:
        raise AssertionError("drafts without speculation")

    def cancel(self, batch: RunningBatch, plan: Plan) -> None:
        raise AssertionError("drafts without speculation")

    def finish(
        self, batch: RunningBatch, plan: Plan, forward: Future[torch.Tensor], rows: list[Req]
    ) -> tuple[SteadyRows | None, int]:
        raise AssertionError("drafts without speculation")


class Speculation:
    def __init__(
        self,
        drafter: Drafter,
        decoder: BatchDecoder,
        kv: KVPool,
        forward: ForwardRunner,
        context_length: int,
    ) -> None:
        self._k = drafter.config.num_speculative_tokens
        self._by_batch_size = drafter.config.disable_by_batch_size
        self._proposer = drafter.proposer
        self._decoder = decoder
        self._kv = kv
        self._forward = forward
        self._context_length = context_length
        self.counters = SpecCounters(self._k)
        deterministic = decoder.runner.model.deterministic
        self._verify_row = VERIFY_ROW + (DETERMINISTIC_ROW if deterministic else 0.0)

    def plan(self, batch: RunningBatch) -> Plan | None:
        """This step's drafts; None when no row drafts (speculation is off for a step of
        more than ``disable_by_batch_size`` rows, for rows in their acceptance backoff, and
        for a step whose drafts are not expected to pay for their verify pass: ``_pays``).
        A row drafts no more tokens than its max_new_tokens and the context leave room for
        after the one the target adds."""
        n = len(batch)
        if not n or (self._by_batch_size and n > self._by_batch_size):
            return None
        rows = batch.spec.drafting(n)
        room = np.minimum(
            batch.params["max_new_tokens"][rows] - batch.output_len(rows) - 1,
            self._context_length - batch.seq_len[rows] - 1,
        )
        rows = rows[room > 0]
        if not rows.size:
            return None
        drafts, counts = self._proposer.propose(batch, rows, self._k)
        counts = np.minimum(counts, room[room > 0])
        full_counts = np.zeros(n, dtype=np.int64)
        full_counts[rows] = counts
        full = np.zeros((n, self._k), dtype=np.int64)
        full[rows] = drafts
        plan = Plan(batch.changes, rows, full_counts, full)
        # The step's own cost check goes with the batch-size limit: 0 turns both off.
        if not plan.num_drafts or (
            self._by_batch_size and not _pays(batch, plan, self._verify_row)
        ):
            self._forget(batch, plan)
            return None
        return plan

    def _forget(self, batch: RunningBatch, plan: Plan) -> None:
        """Drafts that are not verified: the proposer keeps none of them."""
        rows = plan.proposed
        self._proposer.after_verify(batch.req_id[rows], batch.seq_len[rows], np.zeros_like(rows))

    def cancel(self, batch: RunningBatch, plan: Plan) -> None:
        """The pool has no room for the drafts: this step decodes without them."""
        self._forget(batch, plan)

    def launch(self, batch: RunningBatch, plan: Plan, slots: torch.Tensor) -> Future[torch.Tensor]:
        """Starts the verify pass: row r computes its last token and its drafts, whose KV
        goes into ``slots`` (``len(batch) + plan.num_drafts`` of them, in row order). Column
        work: the slots go into the request-to-token table, which the pass reads."""
        assert plan.changes == batch.changes, "the batch changed under its drafts"
        n = len(batch)
        lens = plan.counts + 1
        starts = batch.seq_len[:n] - 1
        new_lens = torch.from_numpy(lens)
        positions = new_positions(torch.from_numpy(starts), new_lens)
        batch.req_to_token[torch.repeat_interleave(torch.arange(n), new_lens), positions] = slots
        width = plan.drafts.shape[1] + 1
        block = np.empty((n, width), dtype=np.int64)
        block[:, 0] = batch.last_tokens()
        block[:, 1:] = plan.drafts
        input_ids = torch.from_numpy(block[np.arange(width) < lens[:, None]])
        kv_lens = starts + lens
        table = batch.req_to_token[:n, : int(kv_lens.max())]
        runner = self._decoder.runner
        pass_ = ForwardBatch.verify(
            input_ids, positions, new_lens, slots, table, torch.from_numpy(kv_lens), runner.device
        )
        adapters = batch.lora_slots()
        lora_tokens = None if adapters is None else np.repeat(adapters, lens)
        return self._forward.submit(runner.verify, pass_, lora_tokens)

    def finish(
        self, batch: RunningBatch, plan: Plan, forward: Future[torch.Tensor], rows: list[Req]
    ) -> tuple[SteadyRows | None, int]:
        """Draws every row's tokens from the verify pass (see the module docstring), gives
        back the KV of the rejected drafts, and settles the step as a decode step does.
        Returns the steady rows and the number of tokens appended."""
        n = len(batch)
        lens = plan.counts + 1
        first = np.cumsum(lens) - lens  # row r's logits start here
        old_seq_len = batch.seq_len[:n].copy()
        code = np.zeros(n, dtype=np.int64)
        check = np.zeros(n, dtype=bool)
        matched = np.zeros(n, dtype=np.int64)  # drafts equal to the token drawn in their place
        at: np.ndarray = np.arange(n)
        prepared = self._decoder.prepare(batch)  # position 0's, while the pass runs
        logits = forward.result()
        for j in range(int(lens.max())):
            if j:
                prepared = self._decoder.prepare(batch, at)
            drawn = self._decoder.draw(batch, logits[torch.from_numpy(first[at] + j)], prepared)
            code[at], check[at] = drawn.code, drawn.check_strings
            going = drawn.code == RUNNING
            for i in np.flatnonzero(drawn.check_strings & going).tolist():
                going[i] = not self._decoder.stops_on_text(batch, int(at[i]))
            column = min(j, plan.drafts.shape[1] - 1)  # past the last draft: no row has one
            hit = (j < plan.counts[at]) & (drawn.new == plan.drafts[at, column])
            matched[at[hit]] += 1
            at = at[hit & going]
            if not at.size:
                break
        appended = batch.seq_len[:n] - old_seq_len
        self._give_back(batch, plan, old_seq_len, appended)
        self._count(batch, plan, matched, old_seq_len)
        return self._decoder.settle(batch, code, check, rows), int(appended.sum())

    def _give_back(
        self, batch: RunningBatch, plan: Plan, old_seq_len: np.ndarray, appended: np.ndarray
    ) -> None:
        """Frees the slots of every row's drafts past those it kept: a row that appended a
        tokens keeps the KV of its old last token and a - 1 drafts (its new last token has
        none yet, as in the running batch's invariant)."""
        n = len(batch)
        unused = plan.counts + 1 - appended
        if not unused.any():
            return
        rows = np.repeat(np.arange(n), unused)
        first = np.repeat(old_seq_len - 1 + appended, unused)
        offsets = np.arange(int(unused.sum())) - np.repeat(np.cumsum(unused) - unused, unused)
        self._kv.free(batch.req_to_token[torch.from_numpy(rows), torch.from_numpy(first + offsets)])

    def _count(
        self, batch: RunningBatch, plan: Plan, matched: np.ndarray, old_seq_len: np.ndarray
    ) -> None:
        """The proposer learns what was accepted; the per-row and the server's counts grow."""
        proposed = plan.proposed
        drafted, accepted = plan.counts[proposed], matched[proposed]
        self._proposer.after_verify(batch.req_id[proposed], old_seq_len[proposed], accepted)
        drafting = proposed[drafted > 0]
        batch.spec.add(drafting, plan.counts[drafting], matched[drafting])
        self.counters.add(drafted, accepted)
