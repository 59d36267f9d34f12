"""An event filled into a template is byte for byte the event ``sse`` encodes whole, for the
shapes the streams fill (/generate, completions, chat) and for texts JSON must escape or
that line readers would cut."""

from __future__ import annotations

import random

import pytest

from tokenizer_proc.http_common import sse
from tokenizer_proc.sse_events import EventTemplate, Hole, TemplateError

TEXTS = ["", "a", " the", "é", "\u2028", "x\x85y", "\u2029\n\r\t\"\\", "\x00\x1f", "✓ “q”", "\ud7ff\ue000", "😀"]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(TEXTS) for _ in range(rng.randrange(4)))


def test_a_generate_event_filled_equals_the_whole_event() -> None:
    rng = random.Random(0)
    text, ids, count = Hole(), Hole(), Hole()
    meta = {"id": "rid\u2028x", "finish_reason": None, "prompt_tokens": 7, "completion_tokens": count, "cached_tokens": 0, "queue_time": 0.125}
    template = EventTemplate({"text": text, "output_ids": ids, "meta_info": meta})
    for _ in range(500):
        t, i, n = _random_text(rng), [rng.randrange(1 << 20) for _ in range(rng.randrange(3))], rng.randrange(10**6)
        whole = sse({"text": t, "output_ids": i, "meta_info": {**meta, "completion_tokens": n}})
        assert template.fill(t, i, n) == whole


@pytest.mark.parametrize("choice", [
    lambda h: {"index": 3, "text": h, "logprobs": None, "finish_reason": None, "stop_reason": None},
    lambda h: {"index": 0, "delta": {"content": h}, "logprobs": None, "finish_reason": None, "stop_reason": None},
])
@pytest.mark.parametrize("usage", [{}, {"usage": None}])
def test_an_openai_chunk_filled_equals_the_whole_chunk(choice, usage) -> None:  # type: ignore[no-untyped-def]
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m\u2029"}
    hole = Hole()
    template = EventTemplate({**head, "choices": [choice(hole)], **usage})
    for text in TEXTS:
        assert template.fill(text) == sse({**head, "choices": [choice(text)], **usage})


def test_a_marker_in_the_constant_parts_is_refused() -> None:
    hole = Hole()
    with pytest.raises(TemplateError):
        EventTemplate({"id": hole.marker, "text": hole})
