"""The logprob keys of a /generate answer or stream event (SGLang's names, docs/design.md
section 11): each entry ``[logprob, token_id, text|null]``; a stream event carries the entries
of the tokens in its ``output_ids``: every token so far (SGLang's default), or its own with
``--incremental-streaming-output``."""

from __future__ import annotations

from typing import Any

from pipeline.io_struct import LogprobParams
from pipeline.token_texts import TokenText
from tokenizer_proc.req_state import LogprobEntries


def logprob_meta(
    asked: LogprobParams, ids: list[int], entries: LogprobEntries | None, text_of: TokenText | None
) -> dict[str, Any]:
    """``ids`` are the tokens the entries belong to; ``text_of`` None: texts are null (not
    asked, or no tokenizer)."""
    entries = entries if entries is not None else LogprobEntries()

    def text(token: int) -> str | None:
        return text_of(token) if text_of is not None else None

    meta: dict[str, Any] = {
        "output_token_logprobs": [[lp, t, text(t)] for lp, t in zip(entries.chosen, ids)]
    }
    if asked.top_logprobs_num:
        meta["output_top_logprobs"] = [[[lp, t, text(t)] for lp, t in top] for top in entries.top]
    if asked.token_ids_logprob:
        asked_ids = asked.token_ids_logprob
        meta["output_token_ids_logprobs"] = [
            [[lp, t, text(t)] for lp, t in zip(values, asked_ids)] for values in entries.ids
        ]
    return meta


def prompt_logprob_meta(
    asked: LogprobParams, prompt_ids: list[int], entries: LogprobEntries, text_of: TokenText | None
) -> dict[str, Any]:
    """SGLang's ``input_*`` keys: one entry per prompt position from ``logprob_start_len``;
    position 0 has no logits before it, so its logprob (and its top and ids entries) are null."""

    def text(token: int) -> str | None:
        return text_of(token) if text_of is not None else None

    start = asked.logprob_start_len
    positions = prompt_ids[start:]
    lead = 1 if start == 0 and prompt_ids else 0  # position 0: null
    chosen: list[Any] = [[None, positions[0], text(positions[0])]] if lead else []
    chosen += [[lp, t, text(t)] for lp, t in zip(entries.chosen, positions[lead:])]
    meta: dict[str, Any] = {"input_token_logprobs": chosen}
    if asked.top_logprobs_num:
        meta["input_top_logprobs"] = [None] * lead + [
            [[lp, t, text(t)] for lp, t in top] for top in entries.top
        ]
    if asked.token_ids_logprob:
        ids = asked.token_ids_logprob
        meta["input_token_ids_logprobs"] = [None] * lead + [
            [[lp, t, text(t)] for lp, t in zip(values, ids)] for values in entries.ids
        ]
    return meta
