"""Finish reasons beyond their wire form: the HTTP form every dialect shows, and the reason
the detokenizer gives a request whose text it lost."""

from __future__ import annotations

from pipeline.io_struct import FinishAbort, FinishReason

# The finish the detokenizer gives a row whose request's first row it never saw (it
# restarted): that request's earlier text is gone, so the row fails it rather than pass as
# output, and the tokenizer manager, seeing this reason, stops the request in the scheduler.
DETOKENIZER_LOST_TEXT = FinishAbort(
    message="the detokenizer restarted and lost this request's text; send it again",
    status_code=503,
)


def finish_reason_to_dict(reason: FinishReason) -> dict[str, object]:
    """The HTTP form (docs/design/wire-types.md): ``{"type": "stop", "matched": ...}`` and so
    on. An optional field left unset (``retry_after``) is not part of that form."""
    out: dict[str, object] = {"type": type(reason).__struct_config__.tag}
    for field in reason.__struct_fields__:
        value = getattr(reason, field)
        if value is not None:
            out[field] = value
    return out
