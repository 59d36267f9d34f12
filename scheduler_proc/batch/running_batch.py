"""The running requests of a generate-mode scheduler as columns, kept in place as requests
join and leave (vLLM's InputBatch is the model), so a steady decode step is column work.

Row ``i`` in ``[0, len(self))`` holds one running request: its tokens (prompt then output),
the pool slot of each token's KV (SGLang's req_to_token), the counts the stop checks and the
stream interval read, its sampling parameters (``param_columns.PARAM_COLUMNS``), the penalty
state the sampler reads, its logprobs (``PendingLogprobs``), whether a grammar constrains
it (its matcher stays on its request: ``Req.matcher``) and its open thinking budget.

Rows are dense: a leaving request's row is filled by the last row (swap-remove), so the step
reads ``[:n]`` slices, never a gather.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from pipeline.io_struct import TOKEN_DTYPE
from scheduler_proc.batch.penalty_tables import PenaltyTables
from scheduler_proc.batch.pending_logprobs import PendingLogprobs, grown
from scheduler_proc.batch.spec_rows import SpecRows
from scheduler_proc.output_builder import SteadyRows
from scheduler_proc.req import Req
from scheduler_proc.sampling.grammar import GrammarMask, GrammarRows
from scheduler_proc.sampling.reasoning_gate import ends_with, open_if_ended
from scheduler_proc.sampling.param_columns import PARAM_COLUMNS, SAMPLER_COLUMNS
from scheduler_proc.sampling.sampler import (
    BannedTokens,
    ForcedTokens,
    SamplingColumns,
    draw_counter,
)
from scheduler_proc.sampling.thinking_budget import NEVER, budget_open, forced_rows

_FIRST_ROWS = 64  # rows allocated up front; the tables double when more requests run

# The batch's own numpy columns with one entry (or one fixed-width block) per row: a
# swap-remove moves each, and growing doubles each (with the sampling parameters' and the
# pending logprobs' columns).
_ROW_COLUMNS = (
    "req_id", "prompt_len", "seq_len", "sent", "joined", "stream", "interval",
    "has_stop_strings", "stop_ids", "stop_count", "seed", "has_bias", "constrained",
    "gate_last", "force_from", "think_last", "lora_slot",
)  # fmt: skip


class RunningBatch:
    """Invariants:

    - A request in the batch has its KV for every token but the last (``seq_len - 1``
      tokens); the decode step writes the last token's KV and appends the new token.
    - While a request is in the batch, the batch is its truth: ``Req.output_ids``,
      ``num_sent_tokens``, ``num_computed`` and ``kv_slots`` are brought up to date only by
      ``sync`` (an event: a finish, a stop string to check, stats due, a retraction, an
      abort), and ``Req.kv_slots`` is None in between, so a stale read fails loudly.
    - A request in the batch has its pending output logprobs in its row (``PendingLogprobs``).
    """

    def __init__(self, context_length: int, vocab_size: int) -> None:
        self._context_length = context_length
        self._vocab_size = vocab_size
        self._n = 0
        self._next_join = 0
        self.reqs: list[Req] = []
        self._row_of: dict[int, int] = {}  # req_id -> row
        self._init_tables(_FIRST_ROWS, context_length)
        self._init_row_columns(_FIRST_ROWS)
        # The sampling parameters' columns, keyed by SamplingParams field (PARAM_COLUMNS).
        self.params: dict[str, np.ndarray] = {
            c.field: np.full(_FIRST_ROWS, c.fill, dtype=c.dtype) for c in PARAM_COLUMNS
        }
        self.logprobs = PendingLogprobs(_FIRST_ROWS)
        self.spec = SpecRows(_FIRST_ROWS)  # speculative decoding's per-row counts
        self._init_grammar_rows()
        # [cap, vocab] penalty state, made when the first request that needs it joins.
        self.penalties = PenaltyTables(vocab_size)
        self.changes = 0  # bumped by every join and leave: rows numbered before may have moved

    def _init_tables(self, cap: int, context_length: int) -> None:
        self.tokens = np.zeros((cap, context_length), dtype=TOKEN_DTYPE)
        self.req_to_token = torch.zeros((cap, context_length), dtype=torch.long)

    def _init_row_columns(self, cap: int) -> None:
        self.req_id = np.zeros(cap, dtype=np.int64)
        self.prompt_len = np.zeros(cap, dtype=np.int64)
        self.seq_len = np.zeros(cap, dtype=np.int64)
        self.sent = np.zeros(cap, dtype=np.int64)  # output tokens already in a frame
        self.joined = np.zeros(cap, dtype=np.int64)  # join order: retraction's last tie-break
        self.stream = np.zeros(cap, dtype=bool)
        self.interval = np.ones(cap, dtype=np.int64)
        self.has_stop_strings = np.zeros(cap, dtype=bool)
        # As wide as the longest stop_token_ids of the rows now running (padded with -1):
        # it widens when a longer list joins and narrows when its last holder leaves.
        self.stop_ids = np.full((cap, 0), -1, dtype=np.int64)
        self.stop_count = np.zeros(cap, dtype=np.int64)  # each row's stop_token_ids
        self.seed = np.zeros(cap, dtype=np.uint64)
        self.has_bias = np.zeros(cap, dtype=bool)
        self.constrained = np.zeros(cap, dtype=bool)  # the request has a grammar (Req.matcher)
        # The last token id of the reasoning end a gated grammar waits for (Req.gate), else -1.
        self.gate_last = np.full(cap, -1, dtype=np.int64)
        # A row with an open thinking budget (thinking_budget.py): the output length from which
        # its tokens are forced, and the last id of its end; else NEVER and -1.
        self.force_from = np.full(cap, NEVER, dtype=np.int64)
        self.think_last = np.full(cap, -1, dtype=np.int64)
        self.lora_slot = np.full(cap, -1, dtype=np.int64)  # its adapter's slot (-1: the base)

    def _init_grammar_rows(self) -> None:
        self._num_constrained = 0
        self._num_gated = 0
        self._num_budgeted = 0  # rows with an open thinking budget
        self._num_lora = 0  # rows that run with a LoRA adapter
        # The constrained rows and their matchers, kept between steps (a steady step builds
        # no list); None: to be gathered again (a constrained row joined, or rows moved).
        self._grammar_rows: GrammarRows | None = None

    @property
    def wants_logprobs(self) -> np.ndarray:
        """Per row: the request asked for logprobs."""
        return self.logprobs.wants

    # --- membership ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Req]:
        return iter(self.reqs)

    def __contains__(self, req: object) -> bool:
        if not isinstance(req, Req):
            return False
        row = self._row_of.get(req.req_id)
        return row is not None and self.reqs[row] is req

    def row_of(self, req: Req) -> int:
        return self._row_of[req.req_id]

    def extend(self, reqs: list[Req]) -> None:
        for req in reqs:
            self.append(req)

    def append(self, req: Req) -> None:
        """A request joins: its tokens, KV slots, counts and parameters become its row."""
        seq_len = req.seq_len
        assert req.output_ids and req.kv_slots is not None and req.num_computed == seq_len - 1, (
            f"{req!r} joins the running batch without KV for all tokens but its last"
        )
        if self._n == len(self.req_id):
            self._grow()
        row = self._n
        self._n += 1
        self.reqs.append(req)
        self._row_of[req.req_id] = row
        prompt = req.origin_input_ids
        self.tokens[row, : len(prompt)] = prompt
        self.tokens[row, len(prompt) : seq_len] = req.output_ids
        self.req_to_token[row, : seq_len - 1] = req.kv_slots
        self.req_id[row] = req.req_id
        self.prompt_len[row] = len(prompt)
        self.seq_len[row] = seq_len
        self.sent[row] = req.num_sent_tokens
        self.joined[row] = self._next_join
        self._next_join += 1
        self.stream[row] = req.stream
        self.interval[row] = req.stream_interval
        self.seed[row] = req.seed
        self._set_sampling_row(row, req)
        self.constrained[row] = req.matcher is not None
        if req.matcher is not None:
            self._num_constrained += 1
            self._grammar_rows = None
        self.gate_last[row] = req.gate.end[-1] if req.gate is not None else -1
        self._num_gated += req.gate is not None
        self._set_budget_row(row, req)
        self.logprobs.set_row(row, req)
        self.spec.set_row(row, req)
        self.penalties.set_row(row, len(self.req_id), req, self.tokens[row, :seq_len])
        self.changes += 1
        self.lora_slot[row] = req.lora_slot
        self._num_lora += req.lora_slot >= 0
        req.kv_slots = None  # the row holds them now (see the class docstring)

    def _set_sampling_row(self, row: int, req: Req) -> None:
        """The request's sampling parameters: each column of ``PARAM_COLUMNS``, and the
        fields carried otherwise (``param_columns.CARRIED_OTHERWISE``)."""
        s = req.sampling
        for column in PARAM_COLUMNS:
            self.params[column.field][row] = getattr(s, column.field)
        self.has_stop_strings[row] = bool(s.stop)
        self.has_bias[row] = bool(s.logit_bias)
        if len(s.stop_token_ids) > self.stop_ids.shape[1]:
            wider = np.full((len(self.req_id), len(s.stop_token_ids)), -1, dtype=np.int64)
            wider[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        self.stop_ids[row] = -1
        self.stop_ids[row, : len(s.stop_token_ids)] = s.stop_token_ids
        self.stop_count[row] = len(s.stop_token_ids)

    def _set_budget_row(self, row: int, req: Req) -> None:
        """A thinking budget stays open while the end is not in the output (found there
        again after a retraction or a PD hand-over); a row its grammar constrains has none."""
        s = req.sampling
        if s.thinking_budget is not None and req.matcher is None and budget_open(s, req.output_ids):
            self.force_from[row] = s.thinking_budget
            self.think_last[row] = s.thinking_end[-1]
            self._num_budgeted += 1
        else:
            self.force_from[row] = NEVER
            self.think_last[row] = -1

    def remove(self, req: Req) -> None:
        """A request leaves (finished, retracted, aborted): ``sync`` first, so the Req holds
        all its tokens and its KV slots again, then the last row moves into its place."""
        row = self._row_of[req.req_id]
        self.sync(req)
        self.hand_over_logprobs(req)
        self.spec.hand_over(row, req)
        self.changes += 1
        req.kv_slots = self.req_to_token[row, : int(self.seq_len[row]) - 1].clone()
        del self._row_of[req.req_id]
        if self._num_constrained:  # the swap below may move a constrained row
            self._num_constrained -= int(self.constrained[row])
            self._grammar_rows = None
        self._num_gated -= int(self.gate_last[row] >= 0)
        self._num_budgeted -= int(self.think_last[row] >= 0)
        self._num_lora -= int(self.lora_slot[row] >= 0)
        width = self.stop_ids.shape[1]
        widest = width > 0 and int(self.stop_count[row]) == width  # the table may narrow
        last = self._n - 1
        if row != last:
            moved = self.reqs[last]
            self.reqs[row] = moved
            self._row_of[moved.req_id] = row
            width = int(self.seq_len[last])
            self.tokens[row, :width] = self.tokens[last, :width]
            self.req_to_token[row, :width] = self.req_to_token[last, :width]
            for column in self._row_columns():
                column[row] = column[last]
            self.penalties.move_row(row, last)
        self.reqs.pop()
        self._n = last
        if widest:
            self._narrow_stop_ids()
        if not last:
            self.logprobs.shrink()

    def _narrow_stop_ids(self) -> None:
        """The stop table back to the widest list still running: one request with many
        stop ids must not make every later step's stop check read them all."""
        width = int(self.stop_count[: self._n].max()) if self._n else 0
        if width < self.stop_ids.shape[1]:
            self.stop_ids = np.ascontiguousarray(self.stop_ids[:, :width])

    def sync(self, req: Req) -> None:
        """Brings the Req's own token list, sent count and computed count up to date with
        its row (its KV slots come back only when it leaves)."""
        row = self._row_of[req.req_id]
        seq_len = int(self.seq_len[row])
        have = len(req.origin_input_ids) + len(req.output_ids)
        if have < seq_len:
            req.output_ids.extend(self.tokens[row, have:seq_len].tolist())
        req.num_sent_tokens = int(self.sent[row])
        req.num_computed = seq_len - 1

    def hand_over_logprobs(self, req: Req) -> None:
        """The row's pending logprobs go back to the request (``Req.pending_logprobs``):
        its row goes out the per-request way, or it leaves the batch."""
        self.logprobs.hand_over(self._row_of[req.req_id], req)

    def note_sent(self, req: Req) -> None:
        """A row of this request went out through the per-request path (an event row)."""
        self.sent[self._row_of[req.req_id]] = req.num_sent_tokens

    def _row_columns(self) -> tuple[np.ndarray, ...]:
        own = tuple(getattr(self, name) for name in _ROW_COLUMNS)
        return own + tuple(self.params.values()) + self.logprobs.columns() + self.spec.columns()

    def _grow(self) -> None:
        cap = 2 * len(self.req_id)
        for name in (*_ROW_COLUMNS, "tokens"):  # ``tokens`` moves by its width, not whole
            setattr(self, name, grown(getattr(self, name), cap))
        self.params = {field: grown(column, cap) for field, column in self.params.items()}
        self.logprobs.grow(cap)
        self.spec.grow(cap)
        self.penalties.grow(cap)
        table = self.req_to_token.new_zeros((cap, self.req_to_token.shape[1]))
        table[: len(self.req_to_token)] = self.req_to_token
        self.req_to_token = table

    # --- the decode step -------------------------------------------------------------------

    def retraction_victim(self) -> Req:
        """The running request to retract first: fewest output tokens, then the longest
        prompt, then the earliest to join."""
        n = self._n
        out = self.seq_len[:n] - self.prompt_len[:n]
        return self.reqs[int(np.lexsort((self.joined[:n], -self.prompt_len[:n], out))[0])]

    def lora_slots(self) -> np.ndarray | None:
        """Each row's adapter slot (-1: the base model); None while no row has an adapter,
        so a step without adapter rows does no LoRA work."""
        return self.lora_slot[: self._n] if self._num_lora else None

    def last_tokens(self) -> np.ndarray:
        n = self._n
        return self.tokens[np.arange(n), self.seq_len[:n] - 1]

    def write_kv_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Puts each row's new KV slot (for its last token) in the table; returns the
        ``[n, max seq_len]`` slice the forward reads."""
        n = self._n
        positions = torch.from_numpy(self.seq_len[:n] - 1)
        self.req_to_token[torch.arange(n), positions] = slots
        return self.req_to_token[:n, : int(self.seq_len[:n].max())]

    def _sel(self, rows: np.ndarray | None) -> slice | np.ndarray:
        """The rows a draw is over: all of them (a slice, no copy), or some (a speculative
        step's verify positions: ``rows`` ascending)."""
        return slice(0, self._n) if rows is None else rows

    def grammar_rows(self, rows: np.ndarray | None = None) -> GrammarRows | None:
        """The constrained rows of a draw over ``rows`` (None: all) and their matchers,
        numbered within the draw; None at once when no row is constrained."""
        if not self._num_constrained:
            return None
        if rows is not None:
            local = np.flatnonzero(self.constrained[rows])
            matchers = [self.reqs[i].matcher for i in rows[local].tolist()]
            found = [m for m in matchers if m is not None]
            return GrammarRows(local, local.tolist(), found) if local.size else None
        if self._grammar_rows is None:
            every = np.flatnonzero(self.constrained[: self._n])
            found = [m for m in (self.reqs[i].matcher for i in every.tolist()) if m is not None]
            assert len(found) == len(every), "a constrained row lost its matcher"
            self._grammar_rows = GrammarRows(every, every.tolist(), found)
        return self._grammar_rows

    def _hits(self, new: np.ndarray, last: np.ndarray, rows: np.ndarray | None) -> list[int]:
        """The batch rows of a draw over ``rows`` whose drawn token (``new``) is ``last``'s."""
        hits = np.flatnonzero(new == last[self._sel(rows)])
        return (hits if rows is None else rows[hits]).tolist()

    def open_gates(self, new: np.ndarray, rows: np.ndarray | None = None) -> None:
        """After a draw over ``rows`` (``new``: each row's token, appended): the gated rows
        whose output now ends with their reasoning's end get their matcher, and are
        constrained from the next draw on. One comparison per draw while a row is gated."""
        if not self._num_gated:
            return
        for row in self._hits(new, self.gate_last, rows):
            req = self.reqs[row]
            assert req.gate is not None, "a gated row lost its gate"
            end = int(self.seq_len[row])
            start = max(int(self.prompt_len[row]), end - len(req.gate.end))
            if open_if_ended(req, self.tokens[row, start:end].tolist()):  # the output's tail
                self.gate_last[row] = -1
                self._num_gated -= 1
                self.constrained[row] = True
                self._num_constrained += 1
                self._grammar_rows = None

    def forced_tokens(self, rows: np.ndarray | None = None) -> ForcedTokens | None:
        """Before a draw over ``rows``: those whose thinking budget is spent take the next id
        of their end (none while constrained: their grammar decides), numbered within the
        draw. One comparison per draw while a budget is open; per-row work on forced rows."""
        if not self._num_budgeted:
            return None
        sel = self._sel(rows)
        out = self.output_len(rows)
        local = np.flatnonzero((out >= self.force_from[sel]) & ~self.constrained[sel])
        at = (local if rows is None else rows[local]).tolist()
        samplings = [self.reqs[r].sampling for r in at]
        return forced_rows(samplings, local.tolist(), out[local].tolist())

    def close_budgets(self, new: np.ndarray, rows: np.ndarray | None = None) -> None:
        """After a draw over ``rows`` (``new``: each row's token, appended): a row whose
        output now ends with its thinking end, forced or not, has its budget closed. One
        comparison per draw while a row's budget is open, as ``open_gates``."""
        if not self._num_budgeted:
            return
        for row in self._hits(new, self.think_last, rows):
            end = self.reqs[row].sampling.thinking_end
            stop = int(self.seq_len[row])
            start = max(int(self.prompt_len[row]), stop - len(end))
            if ends_with(self.tokens[row, start:stop].tolist(), end):
                self.force_from[row] = NEVER
                self.think_last[row] = -1
                self._num_budgeted -= 1

    def sampling_columns(
        self,
        banned: BannedTokens | None = None,
        grammar: GrammarMask | None = None,
        forced: ForcedTokens | None = None,
        rows: np.ndarray | None = None,
    ) -> SamplingColumns:
        """The sampling columns of a draw over ``rows`` (None: all); ``banned``: the tokens
        rows may not draw this step (``StopChecker.min_new_bans``); ``grammar``: the
        constrained rows' mask; ``forced``: the tokens rows must take (``forced_tokens``)."""
        sel = self._sel(rows)
        params = {c.field: self.params[c.field][sel] for c in SAMPLER_COLUMNS}
        tables = self.penalties
        repeats = bool((params["repetition_penalty"] != 1.0).any())
        return SamplingColumns(
            **params,
            seed=self.seed[sel],
            counter=draw_counter(self.output_len(rows)),
            output_counts=tables.rows_of(tables.output_counts, sel, _any_count_penalty(params)),
            seen=tables.rows_of(tables.seen, sel, repeats),
            logit_bias=tables.rows_of(tables.logit_bias, sel, bool(self.has_bias[sel].any())),
            banned=banned,
            grammar=grammar,
            forced=forced,
        )

    def append_tokens(self, new: np.ndarray, rows: np.ndarray | None = None) -> None:
        """One new token for each row of a draw over ``rows`` (None: all)."""
        at = np.arange(self._n) if rows is None else rows
        self.tokens[at, self.seq_len[at]] = new
        self.seq_len[at] += 1
        self.penalties.append(at, new)

    def output_len(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Output tokens so far, per row (of ``rows``; None: all)."""
        sel = self._sel(rows)
        return self.seq_len[sel] - self.prompt_len[sel]

    def due(self, finished: np.ndarray) -> np.ndarray:
        """Which rows go out this step (docs/design.md section 4): finished ones, and streaming ones
        on their first token or once ``stream_interval`` tokens are unsent."""
        n = self._n
        sent = self.sent[:n]
        unsent = self.seq_len[:n] - self.prompt_len[:n] - sent
        return finished | (self.stream[:n] & ((sent == 0) | (unsent >= self.interval[:n])))

    def take_steady(self, rows: np.ndarray, *, with_reqs: bool = False) -> SteadyRows:
        """The frame columns of these rows (req ids, their unsent tokens flat, the count of
        each, completion tokens), and marks those tokens sent. ``with_reqs``: also their
        requests (``--dense-usage-columns``)."""
        completion = self.seq_len[rows] - self.prompt_len[rows]
        counts = completion - self.sent[rows]
        if counts.size and counts.min() == 1 and counts.max() == 1:
            tokens = self.tokens[rows, self.seq_len[rows] - 1]
        else:
            # Several tokens on some rows (a stream interval above one): one gather over
            # the unsent span of each row.
            starts = self.seq_len[rows] - counts
            offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            tokens = self.tokens[np.repeat(rows, counts), np.repeat(starts, counts) + offsets]
        self.sent[rows] = completion
        reqs = [self.reqs[i] for i in rows.tolist()] if with_reqs else []
        return SteadyRows(
            self.req_id[rows], tokens, counts, completion, reqs, self.logprobs.take(rows)
        )

    # --- logprobs (PendingLogprobs holds them) ---------------------------------------------

    def logprob_asks(self, rows: np.ndarray) -> tuple[int, np.ndarray]:
        return self.logprobs.asks(rows)

    def keep_logprobs(
        self, rows: np.ndarray, step: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    ) -> None:
        self.logprobs.keep(rows, step)


def _any_count_penalty(params: dict[str, np.ndarray]) -> bool:
    return bool(params["frequency_penalty"].any() or params["presence_penalty"].any())
