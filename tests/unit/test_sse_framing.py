"""An SSE event is one line however its text reads: clients that split the stream with
str.splitlines (httpx's aiter_lines, requests' iter_lines) end lines at NEL, U+2028 and
U+2029 too, which JSON leaves unescaped; sampled text from a random model held them and a
benchmark client once failed to parse the cut event."""

from __future__ import annotations

import json

import httpx

from tokenizer_proc.http.sse_events import sse

TRICKY = "a\u2028b\x85c\u2029d é\x1c\x1d\x1e\x0b\x0c\r\n\u2027\u00a0"


def test_an_event_is_one_line_for_every_line_reader_and_decodes_to_the_same_text() -> None:
    event = sse({"text": TRICKY, "output_ids": [1, 2]})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    line = event[:-2].decode()
    assert line.splitlines() == [line]
    assert json.loads(line[6:]) == {"text": TRICKY, "output_ids": [1, 2]}
    # And read back the way a common client reads a stream.
    lines = list(httpx.Response(200, content=event * 2).iter_lines())
    assert [json.loads(x[6:])["text"] for x in lines if x] == [TRICKY, TRICKY]


def test_plain_text_is_not_touched() -> None:
    text = "héllo — “quoted” ✓"
    assert (
        sse({"text": text})
        == b"data: "
        + json.dumps({"text": text}, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )
