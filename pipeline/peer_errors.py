"""Error texts that SGLang's and vLLM's clients match on, for the errors more than one process
answers: the peer's words first, tokenpipe's detail after them."""

from __future__ import annotations


def duplicate_rid_message(rid: str) -> str:
    """A live rid sent again: SGLang's words, then ours. The API answers it for its own live
    rids; the scheduler for another API worker's (--api-workers), which that one cannot see."""
    return f"Duplicate request ID detected: {rid} (a request with rid {rid!r} is already running)"
