"""Which API worker an id belongs to. A req_id (and a control message's control_id) carries
the index of the API worker that made it in its high bits, so ids of several workers never
meet and every output row or control answer finds its way back to its worker
(``--api-workers``)."""

from __future__ import annotations

# int64 ids leave room for worker indices below 128.
WORKER_SHIFT = 56
MAX_API_WORKERS = 1 << (63 - WORKER_SHIFT)


def worker_of(req_id: int) -> int:
    """The API worker a req_id or control_id belongs to (negative: scheduler-internal)."""
    return req_id >> WORKER_SHIFT
