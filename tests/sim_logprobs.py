"""Synthetic logprobs for the differential test (docs/design.md sections 9 and 11).

The simulated scheduler gives each generated token, and each prompt position a request
asked for, a ``TokenLogprobs`` shaped as ``step_logprobs`` makes them (float32 chosen
``[1]``, int32 top ids and float32 top values ``[1, k]``, float32 values of the asked ids
``[1, m]``), with values that are a function of (req_id, output or prompt, position) only.
So the test knows every value a client must see, whatever the pipeline did with them:
``expected_entries`` builds them again, rounded to float32 as the wire carries them (and
``LogprobTruth`` keeps them per request, built once), and ``expected_meta`` the /generate
``meta_info`` keys built from them (docs/design.md section 11).

``prefill_chunk`` is the simulated half of
``scheduler_proc.sampling.logprobs.keep_prompt_logprobs``: the positions of one prefill chunk
that predict a prompt token and were not computed before (``Req.prompt_logprobs_next``), so a
re-prefill after a retraction adds nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline.io_struct import LogprobParams
from pipeline.logprob_columns import LOGPROB_DTYPE, LOGPROB_ID_DTYPE, TokenLogprobs
from scheduler_proc.req import Req
from tokenizer_proc.req_state import LogprobEntries

OUTPUT, PROMPT = 1, 2  # which positions a value belongs to: generated tokens or the prompt
_MASK = (1 << 32) - 1


def make_logprob_params(rng: random.Random, vocab_size: int) -> LogprobParams:
    """What a client may ask: 0 to 5 top logprobs, 0 to 3 ids, and prompt logprobs from the
    start (0), from a position (possibly past the prompt's end: none), or none (-1). A
    request asking for prompt logprobs gets a short prompt (``make_req``)."""
    start = rng.choice([-1, -1, -1, 0, 1, rng.randint(0, 60)])
    ids = tuple(rng.randrange(vocab_size) for _ in range(rng.choice([0, 0, 1, 3])))
    return LogprobParams(
        top_logprobs_num=rng.randint(0, 5), logprob_start_len=start, token_ids_logprob=ids
    )


def _values(
    req_id: int, where: int, positions: Sequence[int], ask: LogprobParams, vocab_size: int
) -> tuple[list[Any], ...]:
    """The values of these positions (float64, not float32-exact), one row each: the chosen
    token's, the top ids and values (values strictly descending, ids distinct) and the
    values of the asked ids. Plain Python: most calls are for one position."""
    chosen: list[float] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    ids_values: list[list[float]] = []
    k, asked = ask.top_logprobs_num, ask.token_ids_logprob
    for p in positions:
        h = (req_id * 0x9E3779B1 + p * 0x85EBCA77 + where * 0xC2B2AE3D) & _MASK
        h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & _MASK
        chosen.append(-(h % 100_003) / 9973.0 - 1e-3)
        base = -((h >> 7) % 1000) / 997.0
        top_values.append([base - r * 0.5 - ((h >> (r + 3)) % 100) / 1009.0 for r in range(k)])
        top_ids.append([(h + 97 * r) % vocab_size for r in range(k)])
        ids_values.append([-((h ^ (a * 31)) % 20_011) / 1013.0 - 1e-3 for a in asked])
    return chosen, top_ids, top_values, ids_values


def token_logprobs(
    req_id: int, where: int, positions: Sequence[int], ask: LogprobParams, vocab_size: int
) -> TokenLogprobs:
    """The ``TokenLogprobs`` of these positions, as the scheduler's batched pass hands them over."""
    chosen, top_ids, top_values, ids_values = _values(req_id, where, positions, ask, vocab_size)
    t, k, m = len(chosen), ask.top_logprobs_num, len(ask.token_ids_logprob)
    return TokenLogprobs(
        chosen=np.array(chosen, dtype=LOGPROB_DTYPE),
        top_ids=np.array(top_ids, dtype=LOGPROB_ID_DTYPE).reshape(t, k),
        top_values=np.array(top_values, dtype=LOGPROB_DTYPE).reshape(t, k),
        ids_values=np.array(ids_values, dtype=LOGPROB_DTYPE).reshape(t, m),
    )


def expected_entries(
    req_id: int, where: int, positions: Sequence[int], ask: LogprobParams, vocab_size: int
) -> LogprobEntries:
    """What the tokenizer manager must hold for these positions: the same values, each
    rounded to float32 once (the wire's dtype), as Python floats."""
    chosen, top_ids, top_values, ids_values = _values(req_id, where, positions, ask, vocab_size)
    t, k, m = len(chosen), ask.top_logprobs_num, len(ask.token_ids_logprob)
    flat = chosen + [v for vs in top_values for v in vs] + [v for vs in ids_values for v in vs]
    rounded = np.array(flat, dtype=np.float32).tolist()  # one conversion for them all
    tops, ids = rounded[t : t + t * k], rounded[t + t * k :]
    return LogprobEntries(
        chosen=rounded[:t],
        top=[list(zip(tops[i * k : (i + 1) * k], top_ids[i])) for i in range(t)],
        ids=[ids[i * m : (i + 1) * m] for i in range(t)],
    )


class LogprobTruth:
    """The expected entries of each live request, built once: a request's output entries
    are extended as its tokens are delivered (the count only grows), its prompt's built at
    the first ask. ``forget`` drops a finished request's."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._output: dict[int, LogprobEntries] = {}
        self._prompt: dict[int, LogprobEntries] = {}

    def output(self, req_id: int, ask: LogprobParams, count: int) -> LogprobEntries:
        """The entries of the first ``count`` generated tokens."""
        have = self._output.setdefault(req_id, LogprobEntries())
        if count > len(have.chosen):
            more = expected_entries(
                req_id, OUTPUT, range(len(have.chosen), count), ask, self.vocab_size
            )
            have.chosen += more.chosen
            have.top += more.top
            have.ids += more.ids
        if count == len(have.chosen):
            return have
        return self.between(req_id, ask, 0, count)

    def between(self, req_id: int, ask: LogprobParams, lo: int, hi: int) -> LogprobEntries:
        """The entries of generated tokens ``lo`` to ``hi`` (one stream event's)."""
        have = self.output(req_id, ask, hi)
        return LogprobEntries(have.chosen[lo:hi], have.top[lo:hi], have.ids[lo:hi])

    def prompt(self, req_id: int, ask: LogprobParams, prompt_len: int) -> LogprobEntries:
        """The entries of all the prompt positions asked for."""
        if req_id not in self._prompt:
            self._prompt[req_id] = expected_entries(
                req_id, PROMPT, prompt_positions(ask, prompt_len), ask, self.vocab_size
            )
        return self._prompt[req_id]

    def forget(self, req_id: int) -> None:
        self._output.pop(req_id, None)
        self._prompt.pop(req_id, None)


def prompt_positions(ask: LogprobParams | None, prompt_len: int) -> range:
    """The prompt positions whose logprobs a request gets: max(start, 1) to the end (none
    when not asked). Position q's value is predicted by position q - 1."""
    if ask is None or ask.logprob_start_len < 0:
        return range(0)
    return range(max(ask.logprob_start_len, 1), prompt_len)


def prefill_chunk(req: Req, lo: int, hi: int, vocab_size: int) -> None:
    """A prefill chunk computing tokens [lo, hi) of ``req.fill_ids``: the prompt logprobs of
    the positions it holds that were not computed before, kept on the request."""
    nxt, ask = req.prompt_logprobs_next, req.logprob
    if nxt is None or ask is None:
        return
    last = len(req.origin_input_ids) - 1  # the last predicting position is the one before the end
    first, end = max(nxt, lo), min(hi, last)
    if first < end:
        req.prompt_logprobs.append(
            token_logprobs(req.req_id, PROMPT, range(first + 1, end + 1), ask, vocab_size)
        )
        req.prompt_logprobs_next = None if end == last else end


def expected_meta(
    ask: LogprobParams,
    ids: Sequence[int],
    out: LogprobEntries,
    prompt_ids: Sequence[int] | None,
    prompt: LogprobEntries | None,
    text_of: Callable[[int], str] | None,
) -> dict[str, Any]:
    """The /generate logprob keys (docs/design.md section 11) for output tokens ``ids`` with entries
    ``out``, and, when ``prompt_ids`` is given, the prompt's from ``logprob_start_len``
    (position 0 null), worked out from the expected entries alone."""

    def text(token: int) -> str | None:
        return text_of(token) if text_of is not None else None

    meta: dict[str, Any] = {
        "output_token_logprobs": [[v, t, text(t)] for v, t in zip(out.chosen, ids, strict=True)]
    }
    if ask.top_logprobs_num:
        meta["output_top_logprobs"] = [[[v, i, text(i)] for v, i in top] for top in out.top]
    if ask.token_ids_logprob:
        meta["output_token_ids_logprobs"] = [
            [[v, i, text(i)] for v, i in zip(vs, ask.token_ids_logprob)] for vs in out.ids
        ]
    if prompt_ids is None or prompt is None:
        return meta
    start = ask.logprob_start_len
    shown = list(range(start, len(prompt_ids)))
    computed = len(prompt.chosen)  # the positions after the first shown one, or none
    null = [q for q in shown if q == 0]
    assert computed in (0, len(shown) - len(null)), "prompt entries are all there or none are"
    with_values = shown[len(null) :] if computed else []
    meta["input_token_logprobs"] = [[None, prompt_ids[q], text(prompt_ids[q])] for q in null] + [
        [v, prompt_ids[q], text(prompt_ids[q])]
        for v, q in zip(prompt.chosen, with_values, strict=True)
    ]
    if ask.top_logprobs_num:
        meta["input_top_logprobs"] = [None] * len(null) + [
            [[v, i, text(i)] for v, i in top] for top in prompt.top
        ]
    if ask.token_ids_logprob:
        meta["input_token_ids_logprobs"] = [None] * len(null) + [
            [[v, i, text(i)] for v, i in zip(vs, ask.token_ids_logprob)] for vs in prompt.ids
        ]
    return meta
