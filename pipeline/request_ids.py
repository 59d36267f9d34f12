"""A request's id as its caller names it: the ``X-Request-Id`` header (vLLM's), what a value
of it may hold, and which live requests an abort by an id names.

An OpenAI request runs one pipeline request per choice, with the rid ``{response_id}-{i}``
(``response_id`` is ``chatcmpl-{id}`` or ``cmpl-{id}``), so the caller's id names a family of
rids. ``/abort_request`` by an id aborts the live requests with exactly that rid; when none
has it, every choice of the request it names (``names_choice``): by its response id or by
the caller's id alone. The API worker holding a request and the scheduler (for the other
workers' requests) apply the same rule.
"""

from __future__ import annotations

import re

__all__ = ["HEADER", "MAX_CHARS", "RESPONSE_ID_PREFIXES", "names_choice", "request_id_problem"]

HEADER = "X-Request-Id"
# Enough for a UUID, a trace id or a router's own scheme; an id lands in logs, spans, JSON
# bodies and a response header, so it is printable ASCII without spaces, quotes or commas.
MAX_CHARS = 128
_ALLOWED = re.compile(r"[A-Za-z0-9._~:@+/=-]+")
# The OpenAI response ids' prefixes (tokenizer_proc/openai/shapes.py's ``id_prefix``).
RESPONSE_ID_PREFIXES = ("cmpl-", "chatcmpl-")


def request_id_problem(value: str) -> str | None:
    """What is wrong with ``value`` as a request id, or None."""
    if not value or len(value) > MAX_CHARS:
        return f"{HEADER} must be 1 to {MAX_CHARS} characters (got {len(value)})"
    if _ALLOWED.fullmatch(value) is None:
        return f"{HEADER} may hold only letters, digits and . _ ~ : @ + / = -"
    return None


def names_choice(name: str, rid: str) -> bool:
    """``rid`` is a choice of the OpenAI request ``name`` names: ``{name}-{i}``, or
    ``{prefix}{name}-{i}`` for a response id's prefix."""
    head, dash, index = rid.rpartition("-")
    if not dash or not index.isdigit():
        return False
    return head == name or any(head == prefix + name for prefix in RESPONSE_ID_PREFIXES)
