"""Batched sampling (docs/design.md section 10): one draw per row from counter-based randomness.

A row's token is a function of its logits row, its parameters, its seed and its counter
only: never of its neighbours, of the batch size or of which path the batch took. So a
seeded request samples the same tokens whatever it is batched with, across retraction
(the counter is the output index, not a generator's history) and across PD (the decode
server draws token 1 with counter 1 whatever the prefill server did).

Per row, in order (``sample``): the grammar mask of a constrained row, logit_bias,
penalties, the ban of the tokens a row may not draw yet, temperature, top_k, top_p, min_p,
the draw; a row whose token is forced (``ForcedTokens``) takes it. A greedy row only takes
an argmax; full-width work is paid by sampled rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from pipeline.io_struct import SamplingParams
from scheduler_proc.sampling.grammar import GrammarMask
from scheduler_proc.sampling.param_columns import SAMPLER_COLUMNS
from scheduler_proc.sampling.penalties import (
    adjusted_logits,
    bias_tensor,
    output_count_tensor,
    seen_tensor,
)

__all__ = [
    "GREEDY_EPS",
    "BannedTokens",
    "ForcedTokens",
    "SamplingColumns",
    "adjusted_logits",
    "draw_counter",
    "sample",
]

GREEDY_EPS = 1e-5
_BLOCK = 64  # width of the inverse CDF's first level (the vocabulary is padded to whole blocks)
_MAX_ROUNDS = 32  # top_p rejection rounds before the few rows left are sorted
_EARLY_ROUNDS = 3  # rounds whose uniforms are hashed with the draw's
_PASS_LIMIT = 1 << 16
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


@overload
def draw_counter(output_index: int, pass_index: int = 0) -> np.uint64: ...


@overload
def draw_counter(output_index: np.ndarray, pass_index: int = 0) -> np.ndarray: ...


def draw_counter(output_index: int | np.ndarray, pass_index: int = 0) -> np.uint64 | np.ndarray:
    """The counter of output token ``output_index`` (0: the first generated token); dLLM
    refinement passes over the same position differ by ``pass_index``."""
    if not 0 <= pass_index < _PASS_LIMIT:
        raise ValueError(f"pass_index must be in [0, {_PASS_LIMIT}), got {pass_index}")
    if isinstance(output_index, np.ndarray):
        return output_index.astype(np.uint64) * np.uint64(_PASS_LIMIT) + np.uint64(pass_index)
    return np.uint64(output_index * _PASS_LIMIT + pass_index)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose output bits all depend on every
    input bit. (uint64 arrays wrap silently, as the hash wants.)"""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _streams(seed: np.ndarray, counter: np.ndarray) -> np.ndarray:
    """The hash of (seed, counter) per row, which each round's uniform mixes on from."""
    return _mix(_mix(seed.astype(np.uint64) + np.uint64(_GOLDEN)) + counter.astype(np.uint64))


def _uniforms(streams: np.ndarray, rounds: Sequence[int]) -> np.ndarray:
    """Uniforms in [0, 1), float64, [rows, rounds]: each a pure function of (seed, counter,
    round)."""
    offsets = np.array([(r * _GOLDEN) & _MASK64 for r in rounds], dtype=np.uint64)
    h = _mix(streams[:, None] + offsets)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass(frozen=True, slots=True)
class BannedTokens:
    """(row, token id) pairs the draw must not pick: a row short of ``min_new_tokens`` may not
    draw a token that would stop it (``StopChecker.min_new_bans``), as in SGLang, vLLM and
    transformers. Pairs, not a [n, V] mask, since a few rows ban a few ids each."""

    rows: np.ndarray  # int64 [m]
    ids: np.ndarray  # int64 [m]


@dataclass(frozen=True, slots=True)
class ForcedTokens:
    """The token each of a few rows must take, whatever its logits (a thinking budget
    spent: scheduler_proc/sampling/thinking_budget.py). As a mask allowing that token alone
    would draw it, so the row's draw is replaced by it; no other row's draw changes."""

    rows: np.ndarray  # int64 [m], each row once
    ids: np.ndarray  # int64 [m]


@dataclass(frozen=True, slots=True)
class SamplingColumns:
    """The sampling parameters of n rows as columns (row i samples logits row i). Its
    parameter columns are ``param_columns.SAMPLER_COLUMNS``, named as in ``SamplingParams``;
    both ways of building it (``RunningBatch.sampling_columns``, ``from_requests``) fill
    them from that table."""

    temperature: np.ndarray  # float32 [n]; <= GREEDY_EPS: greedy
    top_k: np.ndarray  # int64 [n]; <= 0 or >= vocab: no cut
    top_p: np.ndarray  # float32 [n]; 1.0: no cut
    min_p: np.ndarray  # float32 [n]; 0.0: no cut
    seed: np.ndarray  # uint64 [n]
    counter: np.ndarray  # uint64 [n]: draw_counter of the token being drawn
    frequency_penalty: np.ndarray  # float32 [n]
    presence_penalty: np.ndarray  # float32 [n]
    repetition_penalty: np.ndarray  # float32 [n]; 1.0: none
    # On the logits' device; each is None when no row needs it.
    output_counts: torch.Tensor | None  # float32 [n, V]: times each token was generated
    seen: torch.Tensor | None  # bool [n, V]: the token occurs in the prompt or the output
    logit_bias: torch.Tensor | None  # float32 [n, V], dense
    banned: BannedTokens | None = None  # None: no row bans a token
    grammar: GrammarMask | None = None  # None: no row is constrained
    forced: ForcedTokens | None = None  # None: no row's token is forced

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        counters: Sequence[int | np.uint64] | np.ndarray,
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        banned: BannedTokens | None = None,
        grammar: GrammarMask | None = None,
        forced: ForcedTokens | None = None,
    ) -> SamplingColumns:
        """Columns built from scratch: the event path (a request's first token, dLLM,
        tests). Per-row Python is fine here; a steady decode step should keep columns
        up to date instead."""
        columns = {
            c.field: np.array([getattr(p, c.field) for p in params], dtype=c.dtype)
            for c in SAMPLER_COLUMNS
        }
        counts_asked = (columns["frequency_penalty"] != 0) | (columns["presence_penalty"] != 0)
        repeats_asked = columns["repetition_penalty"] != 1
        n = len(params)
        return cls(
            **columns,
            seed=np.array([s & _MASK64 for s in seeds], dtype=np.uint64),
            counter=np.array(counters, dtype=np.uint64).reshape(n),
            output_counts=output_count_tensor(
                np.flatnonzero(counts_asked), outputs, n, vocab_size, device
            ),
            seen=seen_tensor(
                np.flatnonzero(repeats_asked), prompts, outputs, n, vocab_size, device
            ),
            logit_bias=bias_tensor([p.logit_bias for p in params], vocab_size, device),
            banned=banned,
            grammar=grammar,
            forced=forced,
        )


def sample(logits: torch.Tensor, cols: SamplingColumns) -> np.ndarray:
    """``logits`` is [n, V], one row per row of ``cols``; returns n token ids, int64.

    First the grammar mask (``grammar.py``: -inf on every token a row's grammar forbids, so
    nothing after it can bring one back), bias and penalties (``penalties.py``) and the ban
    (``BannedTokens``: its stop tokens and EOS while a row is short of ``min_new_tokens``).
    The draw is an inverse CDF over unnormalised weights ``e = exp((x - rowmax) / T)`` (so
    the top token weighs exactly 1 and min_p is ``e >= min_p``) with one uniform per row,
    hashed from (seed, counter, round):

    - greedy rows (T <= GREEDY_EPS): argmax of the adjusted logits;
    - top_k rows: ``torch.topk`` on those rows only, then top_p, min_p and the draw in the
      small sorted [rows, k] space;
    - the others: the inverse CDF in vocabulary order, two-level (block sums, then within
      the block) so no full-width cumsum is needed; top_p rows are then checked by exact
      rejection (redraw among heavier tokens until the draw is in the nucleus), so nothing
      is sorted. The full-width passes are max, subtract, divide, exp and block sums, plus
      one masked sum for the top_p rows (and for the few a rejection round sends back).

    Last, a forced row (``ForcedTokens``) takes its forced token instead of its draw."""
    tokens = _draw(logits, cols)
    if cols.forced is not None:
        tokens[cols.forced.rows] = cols.forced.ids
    return tokens


def _draw(logits: torch.Tensor, cols: SamplingColumns) -> np.ndarray:
    n, vocab = logits.shape
    x = adjusted_logits(logits if cols.grammar is None else cols.grammar.apply(logits), cols)
    if cols.banned is not None:
        x = _ban(x, logits, cols.banned)
    greedy = cols.temperature <= GREEDY_EPS
    if greedy.all():
        return _argmax(x)
    out = np.empty(n, dtype=np.int64)
    rows = np.flatnonzero(greedy)
    if rows.size:
        out[rows] = _argmax(_take(x, rows))
    k = cols.top_k
    cut_k = ~greedy & (k > 0) & (k < vocab)
    # One topk per distinct k: a row's kept set (ties at the k-th value included) must not
    # depend on a neighbour's larger k.
    for kk in np.unique(k[cut_k]) if cut_k.any() else ():
        rows = np.flatnonzero(cut_k & (k == kk))
        out[rows] = _draw_top_k(_take(x, rows), int(kk), _Rows(cols, rows))
    rows = np.flatnonzero(~greedy & ~cut_k)
    if rows.size:
        out[rows] = _draw_full(_take(x, rows), _Rows(cols, rows))
    return out


class _Rows:
    """The scalar columns of a subset of rows, and their uniforms of the first rounds (the
    draw and the rejection rounds most rows never reach, hashed in one go)."""

    __slots__ = ("early", "min_p", "streams", "temperature", "top_p")

    def __init__(self, cols: SamplingColumns, rows: np.ndarray) -> None:
        self.temperature = cols.temperature[rows]
        self.top_p = cols.top_p[rows]
        self.min_p = np.minimum(cols.min_p[rows], 1.0)  # min_p > 1 would cut the top token too
        self.streams = _streams(cols.seed[rows], cols.counter[rows])
        self.early = _uniforms(self.streams, range(_EARLY_ROUNDS))

    def uniforms(self, round_index: int, rows: np.ndarray | None = None) -> np.ndarray:
        if round_index < _EARLY_ROUNDS:
            return self.early[:, round_index] if rows is None else self.early[rows, round_index]
        streams = self.streams if rows is None else self.streams[rows]
        return _uniforms(streams, [round_index])[:, 0]


def _ban(x: torch.Tensor, logits: torch.Tensor, banned: BannedTokens) -> torch.Tensor:
    """``x`` with each banned (row, id) pair at the lowest float32, after bias and
    penalties (so no bias lifts it back). Not -inf: a row whose every token is banned
    then still draws (evenly among them) where -inf would make its weights NaN; any
    allowed token outweighs it, and its weight after exp is exactly 0. A token a grammar
    forbids stays at -inf (a row whose grammar allows only banned tokens draws among
    those, never outside the grammar). Ids outside the vocabulary (a stop id the model
    cannot produce) need no ban. ``logits`` stay as they were: logprobs are the raw
    distribution (docs/design.md section 11)."""
    vocab = x.shape[1]
    keep = (banned.ids >= 0) & (banned.ids < vocab)
    if not keep.any():
        return x
    if x is logits:  # adjusted_logits returns float32 logits themselves when nothing applies
        x = x.clone()
    rows = torch.from_numpy(banned.rows[keep]).to(x.device)
    ids = torch.from_numpy(banned.ids[keep]).to(x.device)
    x.index_put_((rows, ids), x[rows, ids].clamp(max=torch.finfo(x.dtype).min))
    return x


def _take(x: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    if rows.size == x.shape[0]:
        return x
    return x.index_select(0, torch.from_numpy(rows).to(x.device))


def _argmax(logits: torch.Tensor) -> np.ndarray:
    """The greedy token of each row. On the CPU numpy's argmax is an order of magnitude
    faster than torch's; both return the first index of a tie."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return np.argmax(logits.numpy(), axis=-1).astype(np.int64)
    return torch.argmax(logits, dim=-1).cpu().numpy().astype(np.int64)


# --- rows without a top_k cut: inverse CDF in vocabulary order, top_p by rejection ---------


def _draw_full(x: torch.Tensor, r: _Rows) -> np.ndarray:
    e = _weights(x, r.temperature)
    cut_top_p, cut_min_p = r.top_p < 1.0, r.min_p > 0
    nucleus = np.flatnonzero(cut_top_p)
    # top_p is taken on the distribution before the min_p cut: keep the total of the rows
    # with both, computed as the draw computes it for the others (the same row then gets
    # the same total whatever its neighbours ask).
    both = np.flatnonzero(cut_top_p & cut_min_p)
    total_before_min_p = _running_sums(_block_sums(_rows_of(e, both)))[:, -1] if both.size else None
    if cut_min_p.any():
        _cut_min_p(e, np.flatnonzero(cut_min_p), r.min_p)
    tokens, total = _inverse_cdf(e, r.uniforms(0))
    if nucleus.size:
        if total_before_min_p is not None:
            total[both] = total_before_min_p
        tokens[nucleus] = _reject_outside_nucleus(
            _rows_of(e, nucleus), tokens[nucleus], total[nucleus] * r.top_p[nucleus], r, nucleus
        )
    return tokens


def _rows_of(e: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``e[rows]``, without the copy when they are all of e's rows."""
    return e if rows.size == len(e) else e[rows]


def _weights(x: torch.Tensor, temperature: np.ndarray) -> np.ndarray:
    """exp((x - rowmax) / T) in float32 on the host, zero-padded to whole blocks: the top
    token weighs exactly 1 (exp(0)), so min_p needs no normalisation. The subtract and
    divide are torch's, the exp numpy's: each the faster of the two here (and numpy's exp
    is the one whose bits the draws are pinned to)."""
    x = x.detach().to(device="cpu", dtype=torch.float32)
    m, vocab = x.shape
    width = -(-vocab // _BLOCK) * _BLOCK
    e = torch.empty((m, width), dtype=torch.float32)
    e[:, vocab:] = 0.0
    body = e[:, :vocab]
    torch.sub(x, x.amax(dim=1, keepdim=True), out=body)
    if (temperature != 1.0).any():  # x / 1.0 is x: the batch-level test changes no row
        body.div_(torch.from_numpy(temperature).unsqueeze(1))
    out = body.numpy()
    np.exp(out, out=out)
    return e.numpy()


def _cut_min_p(e: np.ndarray, rows: np.ndarray, min_p: np.ndarray) -> None:
    """min_p on ``rows`` of ``e``, in place: weights below min_p (the top token's is 1)
    become 0 (e * False). The other rows are not touched."""
    cut = _rows_of(e, rows)
    np.multiply(cut, cut >= min_p[rows, None], out=cut)
    if cut is not e:
        e[rows] = cut


def _inverse_cdf(e: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the token t at which the running sum of ``e`` first exceeds u * total, and
    the totals (float64). Two levels: pick the block by its running sum, then the token
    within it. A token of weight 0 is never returned, whatever the rounding."""
    m, width = e.shape
    block_sums = _block_sums(e)
    cum = np.zeros((m, width // _BLOCK + 1), dtype=np.float64)
    cum[:, 1:] = _running_sums(block_sums)
    total = cum[:, -1]
    target = u * total
    b = _first_above(cum[:, 1:], target, block_sums)
    rows = np.arange(m)
    within = e.reshape(m, width // _BLOCK, _BLOCK)[rows, b]
    # cum[:, b] is the running sum before block b (cum's column 0 is 0).
    j = _first_above(_running_sums(within), target - cum[rows, b], within)
    return b * _BLOCK + j, total


def _running_sums(w: np.ndarray) -> np.ndarray:
    """float64 running sums of each row of ``w``, added one by one in order. torch's
    cumsum adds in the same order as numpy's (a float64 accumulator) and is several times
    faster on short rows."""
    return torch.cumsum(torch.from_numpy(w), dim=1, dtype=torch.float64).numpy()


def _block_sums(e: np.ndarray) -> np.ndarray:
    """float32 [m, width / _BLOCK]; torch's, faster than numpy's for 64-wide sums."""
    m, width = e.shape
    return torch.from_numpy(e).view(m, width // _BLOCK, _BLOCK).sum(dim=-1).numpy()


def _first_above(cum: np.ndarray, target: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The first index whose running sum exceeds the target. Its running sum grew there, so
    its weight is positive. When rounding puts the target at or past the end (a float32
    block sum above the float64 sum of its tokens, u * total == total), the last index of
    positive weight instead."""
    idx = (cum <= target[:, None]).sum(axis=1)
    past = idx >= cum.shape[1]
    if past.any():
        idx[past] = cum.shape[1] - 1 - np.argmax(weights[past][:, ::-1] > 0, axis=1)
    return idx


def _reject_outside_nucleus(
    e: np.ndarray, tokens: np.ndarray, mass: np.ndarray, r: _Rows, rows: np.ndarray
) -> np.ndarray:
    """Exact top_p by rejection (as FlashInfer's): the nucleus keeps token t when the weight
    of the tokens strictly heavier than t is below ``mass`` (top_p of the total; the top
    token always stays). A draw outside it rules out every token as light as it, so the row
    redraws among the heavier ones with its next round's uniform. The accepted draw is
    distributed as e restricted to the nucleus. Rows still out after _MAX_ROUNDS are sorted."""
    tokens = tokens.copy()
    pending = np.arange(len(rows))
    w = e
    for round_index in range(1, _MAX_ROUNDS + 1):
        drawn = w[np.arange(len(w)), tokens[pending]]
        # A draw of the top token (weight 1) is in the nucleus: its row needs no test. Such
        # rows are dropped from the full-width test when copying the others costs less (from
        # two fifths of the rows, measured); a row's masked sum does not depend on the rows
        # beside it.
        tested = drawn < 1.0
        if 5 * np.count_nonzero(tested) <= 3 * len(tested):
            pending, w, drawn = pending[tested], w[tested], drawn[tested]
        heavier_than_drawn = w > drawn[:, None]
        heavier = np.einsum("ij,ij->i", w, heavier_than_drawn)
        out = (heavier >= mass[pending]) & (drawn < 1.0)
        if not out.any():
            return tokens
        pending = pending[out]
        # The rejected token and every one as light are out.
        w = w[out] * heavier_than_drawn[out]
        u = r.uniforms(round_index, rows[pending])
        tokens[pending], _ = _inverse_cdf(w, u)
    # Rare (a nucleus of many near-equal tokens): an exact sort of the rows left.
    tokens[pending] = _sorted_draw(w, mass[pending], r.uniforms(_MAX_ROUNDS + 1, rows[pending]))
    return tokens


# --- sorted space: top_k rows, and the rejection's fallback --------------------------------


def _draw_top_k(x: torch.Tensor, k: int, r: _Rows) -> np.ndarray:
    """The top_k cut by torch.topk on these rows only; top_p (on the top-k-renormalised
    distribution), min_p and the draw then run in the small sorted [rows, k] space."""
    values, ids = torch.topk(x.float(), k, dim=1)  # sorted, descending
    v = values.cpu().numpy()
    e = np.exp((v - v[:, :1]) / r.temperature[:, None])  # the top token weighs exactly 1
    mass = e.sum(axis=1, dtype=np.float64) * np.where(r.top_p < 1.0, r.top_p, np.inf)
    np.multiply(e, e >= r.min_p[:, None], out=e)
    j = _sorted_draw(e, mass, r.uniforms(0), presorted=True)
    return ids.cpu().numpy()[np.arange(len(j)), j]


def _sorted_draw(
    w: np.ndarray, mass: np.ndarray, u: np.ndarray, *, presorted: bool = False
) -> np.ndarray:
    """Inverse CDF over the nucleus of ``w`` in descending order: a token stays when the
    weight strictly heavier than it is below ``mass`` (ties all stay or all go, as in the
    rejection), and the top token always stays. Returns indices into ``w``'s columns."""
    order = None if presorted else np.argsort(-w, axis=1, kind="stable")
    s = w if order is None else np.take_along_axis(w, order, axis=1)
    # The weight strictly heavier than each token: the running sum before its tie group.
    before = np.zeros(s.shape, dtype=np.float64)
    np.cumsum(s[:, :-1], axis=1, dtype=np.float64, out=before[:, 1:])
    starts = np.where(np.diff(s, axis=1, prepend=np.inf) != 0, np.arange(s.shape[1]), 0)
    heavier = np.take_along_axis(before, np.maximum.accumulate(starts, axis=1), axis=1)
    s = np.where((heavier < mass[:, None]) | (heavier == 0), s, 0.0)
    cum = np.cumsum(s, axis=1, dtype=np.float64)
    j = _first_above(cum, u * cum[:, -1], s)
    return j if order is None else order[np.arange(len(j)), j]
