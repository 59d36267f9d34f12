"""The running requests of a generate-mode scheduler as columns, kept in place as requests
join and leave (vLLM's InputBatch is the model), so a steady decode step is column work.

Row ``i`` in ``[0, len(self))`` holds one running request. Per row it keeps the request's
tokens (prompt then output) in a token table, the pool slot of each token's KV in a
request-to-token table (SGLang's req_to_token), the counts the stop checks and the stream
interval read, the sampling parameters, the penalty state the sampler reads, and the
logprobs a row asked for together with those of its tokens not yet sent (a pending table:
``[rows, tokens, k]``, widened when a row needs more room), and which rows a grammar
constrains (their matchers stay on their requests: ``Req.matcher``).

Invariants:
- A request in the batch has its KV for every token but the last (``seq_len - 1``
  tokens); the decode step writes the last token's KV and appends the new token.
- While a request is in the batch, the batch is its truth: ``Req.output_ids``,
  ``num_sent_tokens``, ``num_computed`` and ``kv_slots`` are brought up to date only by
  ``sync`` (an event: a finish, a stop string to check, stats due, a retraction, an abort),
  and ``Req.kv_slots`` is None in between, so a stale read fails loudly.
- A request in the batch has its pending output logprobs in its row, none in
  ``Req.pending_logprobs``: they move into the row when it joins, and back to the request
  (``hand_over_logprobs``) when its row goes out the per-request way or it leaves.
- Rows are dense: a leaving request's row is filled by the last row (swap-remove), so the
  step reads ``[:n]`` slices, never a gather.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from pipeline.io_struct import TOKEN_DTYPE
from pipeline.logprob_columns import LOGPROB_DTYPE, LOGPROB_ID_DTYPE, LogprobBlock, TokenLogprobs
from scheduler_proc.output_builder import SteadyRows
from scheduler_proc.req import Req
from scheduler_proc.sampling.grammar import GrammarMask, GrammarRows
from scheduler_proc.sampling.sampler import BannedTokens, SamplingColumns, draw_counter

_FIRST_ROWS = 64  # rows allocated up front; the tables double when more requests run
_FIRST_PENDING = 4  # tokens of pending logprobs a row holds at first; doubled when one needs more


# The numpy columns with one entry (or one fixed-width block) per row: a swap-remove moves
# each, and growing doubles each.
_ROW_COLUMNS = (
    "req_id", "prompt_len", "seq_len", "sent", "joined", "max_new", "min_new", "ignore_eos", "stream",
    "interval", "has_stop_strings", "stop_ids", "stop_count", "seed", "temperature", "top_k", "top_p", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "has_bias", "wants_logprobs",
    "top_k_asked", "ids_asked", "ids_count", "lp_count", "lp_chosen", "lp_top_ids", "lp_top_values",
    "lp_ids_values", "constrained",
)  # fmt: skip


class RunningBatch:
    def __init__(self, context_length: int, vocab_size: int) -> None:
        self._context_length = context_length
        self._vocab_size = vocab_size
        self._n = 0
        self._next_join = 0
        self.reqs: list[Req] = []
        self._row_of: dict[int, int] = {}  # req_id -> row
        cap = _FIRST_ROWS
        self.tokens = np.zeros((cap, context_length), dtype=TOKEN_DTYPE)
        self.req_to_token = torch.zeros((cap, context_length), dtype=torch.long)
        self.req_id = np.zeros(cap, dtype=np.int64)
        self.prompt_len = np.zeros(cap, dtype=np.int64)
        self.seq_len = np.zeros(cap, dtype=np.int64)
        self.sent = np.zeros(cap, dtype=np.int64)  # output tokens already in a frame
        self.joined = np.zeros(cap, dtype=np.int64)  # join order: retraction's last tie-break
        self.max_new = np.zeros(cap, dtype=np.int64)
        self.min_new = np.zeros(cap, dtype=np.int64)
        self.ignore_eos = np.zeros(cap, dtype=bool)
        self.stream = np.zeros(cap, dtype=bool)
        self.interval = np.ones(cap, dtype=np.int64)
        self.has_stop_strings = np.zeros(cap, dtype=bool)
        # As wide as the longest stop_token_ids of the rows now running (padded with -1):
        # it widens when a longer list joins and narrows when its last holder leaves.
        self.stop_ids = np.full((cap, 0), -1, dtype=np.int64)
        self.stop_count = np.zeros(cap, dtype=np.int64)  # each row's stop_token_ids
        self.seed = np.zeros(cap, dtype=np.uint64)
        self.temperature = np.zeros(cap, dtype=np.float32)
        self.top_k = np.zeros(cap, dtype=np.int64)
        self.top_p = np.ones(cap, dtype=np.float32)
        self.min_p = np.zeros(cap, dtype=np.float32)
        self.frequency_penalty = np.zeros(cap, dtype=np.float32)
        self.presence_penalty = np.zeros(cap, dtype=np.float32)
        self.repetition_penalty = np.ones(cap, dtype=np.float32)
        self.has_bias = np.zeros(cap, dtype=bool)
        self.wants_logprobs = np.zeros(cap, dtype=bool)
        # int32 as on the wire, so the frame's columns need no conversion.
        self.top_k_asked = np.zeros(cap, dtype=np.int32)  # top_logprobs_num
        self.ids_asked = np.zeros((cap, 0), dtype=np.int64)  # token_ids_logprob, padded with 0
        self.ids_count = np.zeros(cap, dtype=np.int32)
        # Pending logprobs: of each row's first ``lp_count`` unsent tokens, in order.
        self.lp_count = np.zeros(cap, dtype=np.int64)
        self.lp_chosen = np.zeros((cap, _FIRST_PENDING), dtype=LOGPROB_DTYPE)
        self.lp_top_ids = np.zeros((cap, _FIRST_PENDING, 0), dtype=LOGPROB_ID_DTYPE)
        self.lp_top_values = np.zeros((cap, _FIRST_PENDING, 0), dtype=LOGPROB_DTYPE)
        self.lp_ids_values = np.zeros((cap, _FIRST_PENDING, 0), dtype=LOGPROB_DTYPE)
        self.constrained = np.zeros(cap, dtype=bool)  # the request has a grammar (Req.matcher)
        self._num_constrained = 0
        # The constrained rows and their matchers, kept between steps (a steady step builds
        # no list); None: to be gathered again (a constrained row joined, or rows moved).
        self._grammar_rows: GrammarRows | None = None
        # [cap, vocab] penalty state, made when the first request that needs it joins.
        self.output_counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.logit_bias: torch.Tensor | None = None

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
        s = req.sampling
        self.req_id[row] = req.req_id
        self.prompt_len[row] = len(prompt)
        self.seq_len[row] = seq_len
        self.sent[row] = req.num_sent_tokens
        self.joined[row] = self._next_join
        self._next_join += 1
        self.max_new[row] = s.max_new_tokens
        self.min_new[row] = s.min_new_tokens
        self.ignore_eos[row] = s.ignore_eos
        self.stream[row] = req.stream
        self.interval[row] = req.stream_interval
        self.has_stop_strings[row] = bool(s.stop)
        if len(s.stop_token_ids) > self.stop_ids.shape[1]:
            wider = np.full((len(self.req_id), len(s.stop_token_ids)), -1, dtype=np.int64)
            wider[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        self.stop_ids[row] = -1
        self.stop_ids[row, : len(s.stop_token_ids)] = s.stop_token_ids
        self.stop_count[row] = len(s.stop_token_ids)
        self.seed[row] = req.seed
        self.temperature[row] = s.temperature
        self.top_k[row] = s.top_k
        self.top_p[row] = s.top_p
        self.min_p[row] = s.min_p
        self.frequency_penalty[row] = s.frequency_penalty
        self.presence_penalty[row] = s.presence_penalty
        self.repetition_penalty[row] = s.repetition_penalty
        self.has_bias[row] = bool(s.logit_bias)
        self.constrained[row] = req.matcher is not None
        if req.matcher is not None:
            self._num_constrained += 1
            self._grammar_rows = None
        self._set_logprob_row(row, req)
        self._set_penalty_rows(row, req)
        req.kv_slots = None  # the row holds them now (see the module docstring)

    def _set_logprob_row(self, row: int, req: Req) -> None:
        """What the request asks, and its pending logprobs (a first token not sent yet,
        tokens left unsent at a retraction) moved into the row."""
        asked = req.logprob
        self.wants_logprobs[row] = asked is not None
        self.lp_count[row] = 0
        if asked is None:
            return
        ids = asked.token_ids_logprob
        self._widen_logprobs(k=asked.top_logprobs_num, m=len(ids))
        self.top_k_asked[row] = asked.top_logprobs_num
        self.ids_count[row] = len(ids)
        self.ids_asked[row] = 0
        self.ids_asked[row, : len(ids)] = ids
        part = req.take_pending_logprobs()
        if part is not None:
            t, k, m = len(part.chosen), part.top_ids.shape[1], part.ids_values.shape[1]
            self._widen_logprobs(t=t)
            self.lp_chosen[row, :t] = part.chosen
            self.lp_top_ids[row, :t, :k] = part.top_ids
            self.lp_top_values[row, :t, :k] = part.top_values
            self.lp_ids_values[row, :t, :m] = part.ids_values
            self.lp_count[row] = t

    def _widen_logprobs(self, *, t: int = 0, k: int = 0, m: int = 0) -> None:
        """Room for ``t`` pending tokens a row (doubling), ``k`` top entries and ``m``
        asked ids a token; the columns only grow."""
        have_t, have_k, have_m = (
            self.lp_chosen.shape[1],
            self.lp_top_ids.shape[2],
            self.lp_ids_values.shape[2],
        )
        if t <= have_t and k <= have_k and m <= have_m:
            return
        new_t = max(have_t, 1) if t <= have_t else max(t, 2 * have_t)
        new_k, new_m = max(k, have_k), max(m, have_m)
        cap = len(self.req_id)
        for name, shape in (
            ("lp_chosen", (cap, new_t)),
            ("lp_top_ids", (cap, new_t, new_k)),
            ("lp_top_values", (cap, new_t, new_k)),
            ("lp_ids_values", (cap, new_t, new_m)),
            ("ids_asked", (cap, new_m)),
        ):
            old = getattr(self, name)
            new = np.zeros(shape, dtype=old.dtype)
            new[tuple(slice(0, d) for d in old.shape)] = old
            setattr(self, name, new)

    def _set_penalty_rows(self, row: int, req: Req) -> None:
        s = req.sampling
        if s.frequency_penalty or s.presence_penalty:
            if self.output_counts is None:
                self.output_counts = torch.zeros(
                    (len(self.req_id), self._vocab_size), dtype=torch.float32
                )
            counts = np.bincount(req.output_ids, minlength=self._vocab_size)
            self.output_counts[row] = torch.from_numpy(counts.astype(np.float32))
        elif self.output_counts is not None:
            self.output_counts[row] = 0
        if s.repetition_penalty != 1.0:
            if self.seen is None:
                self.seen = torch.zeros((len(self.req_id), self._vocab_size), dtype=torch.bool)
            self.seen[row] = False
            self.seen[row, torch.from_numpy(self.tokens[row, : req.seq_len].astype(np.int64))] = (
                True
            )
        elif self.seen is not None:
            self.seen[row] = False
        if s.logit_bias:
            if self.logit_bias is None:
                self.logit_bias = torch.zeros(
                    (len(self.req_id), self._vocab_size), dtype=torch.float32
                )
            self.logit_bias[row] = 0
            ids, values = zip(*s.logit_bias)
            self.logit_bias[row, list(ids)] = torch.tensor(values, dtype=torch.float32)
        elif self.logit_bias is not None:
            self.logit_bias[row] = 0

    def remove(self, req: Req) -> None:
        """A request leaves (finished, retracted, aborted): ``sync`` first, so the Req holds
        all its tokens and its KV slots again, then the last row moves into its place."""
        row = self._row_of[req.req_id]
        self.sync(req)
        self.hand_over_logprobs(req)
        req.kv_slots = self.req_to_token[row, : int(self.seq_len[row]) - 1].clone()
        del self._row_of[req.req_id]
        if self._num_constrained:  # the swap below may move a constrained row
            self._num_constrained -= int(self.constrained[row])
            self._grammar_rows = None
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
            for table in (self.output_counts, self.seen, self.logit_bias):
                if table is not None:
                    table[row] = table[last]
        self.reqs.pop()
        self._n = last
        if widest:
            self._narrow_stop_ids()
        if not last and self.lp_chosen.shape[1] > _FIRST_PENDING:
            self._shrink_pending()  # long unsent runs (non-streaming requests) are over: free their room

    def _narrow_stop_ids(self) -> None:
        """The stop table back to the widest list still running: one request with many
        stop ids must not make every later step's stop check read them all."""
        width = int(self.stop_count[: self._n].max()) if self._n else 0
        if width < self.stop_ids.shape[1]:
            self.stop_ids = np.ascontiguousarray(self.stop_ids[:, :width])

    def _shrink_pending(self) -> None:
        cap, k, m = len(self.req_id), self.lp_top_ids.shape[2], self.lp_ids_values.shape[2]
        self.lp_chosen = np.zeros((cap, _FIRST_PENDING), dtype=LOGPROB_DTYPE)
        self.lp_top_ids = np.zeros((cap, _FIRST_PENDING, k), dtype=LOGPROB_ID_DTYPE)
        self.lp_top_values = np.zeros((cap, _FIRST_PENDING, k), dtype=LOGPROB_DTYPE)
        self.lp_ids_values = np.zeros((cap, _FIRST_PENDING, m), dtype=LOGPROB_DTYPE)

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
        row = self._row_of[req.req_id]
        t = int(self.lp_count[row])
        if not t:
            return
        k, m = int(self.top_k_asked[row]), int(self.ids_count[row])
        req.pending_logprobs.append(
            TokenLogprobs(
                self.lp_chosen[row, :t].copy(),
                self.lp_top_ids[row, :t, :k].copy(),
                self.lp_top_values[row, :t, :k].copy(),
                self.lp_ids_values[row, :t, :m].copy(),
            )
        )
        self.lp_count[row] = 0

    def note_sent(self, req: Req) -> None:
        """A row of this request went out through the per-request path (an event row)."""
        self.sent[self._row_of[req.req_id]] = req.num_sent_tokens

    def _row_columns(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, name) for name in _ROW_COLUMNS)

    def _grow(self) -> None:
        cap = 2 * len(self.req_id)
        for name in (*_ROW_COLUMNS, "tokens"):  # ``tokens`` moves by its width, not whole
            old = getattr(self, name)
            new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        for name in ("req_to_token", "output_counts", "seen", "logit_bias"):
            old = getattr(self, name)
            if old is not None:
                new = old.new_zeros((cap, *old.shape[1:]))
                new[: len(old)] = old
                setattr(self, name, new)

    # --- the decode step -------------------------------------------------------------------

    def retraction_victim(self) -> Req:
        """The running request to retract first: fewest output tokens, then the longest
        prompt, then the earliest to join."""
        n = self._n
        out = self.seq_len[:n] - self.prompt_len[:n]
        return self.reqs[int(np.lexsort((self.joined[:n], -self.prompt_len[:n], out))[0])]

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

    def grammar_rows(self) -> GrammarRows | None:
        """The constrained rows and their matchers; None at once when no row is constrained."""
        if not self._num_constrained:
            return None
        if self._grammar_rows is None:
            rows = np.flatnonzero(self.constrained[: self._n])
            matchers = [m for m in (self.reqs[i].matcher for i in rows.tolist()) if m is not None]
            assert len(matchers) == len(rows), "a constrained row lost its matcher"
            self._grammar_rows = GrammarRows(rows, rows.tolist(), matchers)
        return self._grammar_rows

    def sampling_columns(
        self, banned: BannedTokens | None = None, grammar: GrammarMask | None = None
    ) -> SamplingColumns:
        """The rows' sampling columns; ``banned``: the tokens rows may not draw this step
        (``StopChecker.min_new_bans``); ``grammar``: the constrained rows' mask."""
        n = self._n
        any_penalty = bool(self.frequency_penalty[:n].any() or self.presence_penalty[:n].any())
        return SamplingColumns(
            temperature=self.temperature[:n],
            top_k=self.top_k[:n],
            top_p=self.top_p[:n],
            min_p=self.min_p[:n],
            seed=self.seed[:n],
            counter=draw_counter(self.seq_len[:n] - self.prompt_len[:n]),
            frequency_penalty=self.frequency_penalty[:n],
            presence_penalty=self.presence_penalty[:n],
            repetition_penalty=self.repetition_penalty[:n],
            output_counts=self.output_counts[:n]
            if any_penalty and self.output_counts is not None
            else None,
            seen=self.seen[:n]
            if self.seen is not None and bool((self.repetition_penalty[:n] != 1.0).any())
            else None,
            logit_bias=self.logit_bias[:n]
            if self.logit_bias is not None and bool(self.has_bias[:n].any())
            else None,
            banned=banned,
            grammar=grammar,
        )

    def append_tokens(self, new: np.ndarray) -> None:
        """One new token per row, sampled from this step's logits."""
        n = self._n
        rows = np.arange(n)
        self.tokens[rows, self.seq_len[:n]] = new
        self.seq_len[:n] += 1
        if self.output_counts is not None or self.seen is not None:
            index = (torch.from_numpy(rows), torch.from_numpy(new.astype(np.int64)))
            if self.output_counts is not None:
                self.output_counts.index_put_(index, torch.ones(n), accumulate=True)
            if self.seen is not None:
                self.seen[index] = True

    def output_len(self) -> np.ndarray:
        """Output tokens so far, per row."""
        n = self._n
        return self.seq_len[:n] - self.prompt_len[:n]

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
            self.req_id[rows], tokens, counts, completion, reqs, self._take_logprobs(rows)
        )

    # --- logprobs --------------------------------------------------------------------------

    def logprob_asks(self, rows: np.ndarray) -> tuple[int, np.ndarray]:
        """What these rows ask for: the largest top-k, and the asked ids (``[rows, m]``,
        padded with 0, m the most any of them asks)."""
        if not rows.size:
            return 0, self.ids_asked[rows, :0]
        return int(self.top_k_asked[rows].max()), self.ids_asked[
            rows, : int(self.ids_count[rows].max())
        ]

    def keep_logprobs(
        self, rows: np.ndarray, step: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    ) -> None:
        """One new token's logprobs for each of ``rows`` (chosen ``[r]``, top ids and values
        ``[r, k]``, ids values ``[r, m]``, as ``logprobs.batched_logprobs`` makes them),
        appended to their pending ones: one write per column."""
        chosen, top_ids, top_values, ids_values = step
        at = self.lp_count[rows]
        if at.size and int(at.max()) >= self.lp_chosen.shape[1]:
            self._widen_logprobs(t=int(at.max()) + 1)
        k, m = top_ids.shape[1], ids_values.shape[1]
        self.lp_chosen[rows, at] = chosen
        if k:
            self.lp_top_ids[rows, at, :k] = top_ids
            self.lp_top_values[rows, at, :k] = top_values
        if m:
            self.lp_ids_values[rows, at, :m] = ids_values
        self.lp_count[rows] = at + 1

    def _take_logprobs(self, rows: np.ndarray) -> LogprobBlock | None:
        """The pending logprobs of those of ``rows`` that have some, as frame columns (one
        gather per column), and marks them sent. Cold caches after the step's forward make
        each numpy call cost microseconds, so the common case (every row holds one token,
        no ids asked) takes the fewest."""
        counts = self.lp_count[rows]
        most = int(counts.max()) if counts.size else 0
        if not most:
            return None
        held: np.ndarray  # positions among ``rows`` that hold entries
        if int(counts.min()):
            held, r = np.arange(len(rows), dtype=np.int32), rows
        else:  # rows that asked nothing (or hold nothing) carry no entry
            held = np.flatnonzero(counts)
            r, counts = rows[held], counts[held]
        self.lp_count[r] = 0
        k, m = self.top_k_asked[r], self.ids_count[r]
        if most == 1:  # one token each (the steady case): column 0
            at: np.ndarray | int = 0
            per_token, token_k, token_m = r, k, m
        else:
            at = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            per_token, token_k, token_m = (
                np.repeat(r, counts),
                np.repeat(k, counts),
                np.repeat(m, counts),
            )
        top_ids, top_values = _ragged(token_k, self.lp_top_ids, self.lp_top_values, per_token, at)
        if self.lp_ids_values.shape[2]:
            ids_values = _ragged(token_m, self.lp_ids_values, None, per_token, at)[0]
        else:  # no running request ever asked for ids
            ids_values = self.lp_ids_values[:0, 0, :0].reshape(0)
        return LogprobBlock(
            held, self.lp_chosen[per_token, at], k, top_ids, top_values, m, ids_values
        )


def _ragged(
    width: np.ndarray, a: np.ndarray, b: np.ndarray | None, rows: np.ndarray, at: np.ndarray | int
) -> tuple[np.ndarray, np.ndarray]:
    """The first ``width[i]`` entries of ``a[rows[i], at[i]]`` (and of ``b``'s), flat, row
    after row: one gather, then a mask only where widths differ."""
    most = int(width.max())
    block_a = a[rows, at, :most]
    block_b = b[rows, at, :most] if b is not None else block_a
    if int(width.min()) == most:
        return block_a.reshape(-1), block_b.reshape(-1)
    keep = np.arange(most) < width[:, None]
    return block_a[keep], block_b[keep]
