"""An event filled into a template is byte for byte the event ``sse`` encodes whole, for the
shapes the streams fill (/generate, completions, chat) and for texts JSON must escape or
that line readers would cut."""

from __future__ import annotations

import random

import pytest

from tokenizer_proc.http.sse_events import EventTemplate, Hole, TemplateError, sse

TEXTS = [
    "",
    "a",
    " the",
    "é",
    "\u2028",
    "x\x85y",
    '\u2029\n\r\t"\\',
    "\x00\x1f",
    "✓ “q”",
    "\ud7ff\ue000",
    "😀",
]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(TEXTS) for _ in range(rng.randrange(4)))


def test_a_generate_event_filled_equals_the_whole_event() -> None:
    rng = random.Random(0)
    text, ids, count = Hole(), Hole(), Hole()
    meta = {
        "id": "rid\u2028x",
        "finish_reason": None,
        "prompt_tokens": 7,
        "completion_tokens": count,
        "cached_tokens": 0,
        "queue_time": 0.125,
    }
    template = EventTemplate({"text": text, "output_ids": ids, "meta_info": meta})
    for _ in range(500):
        t, i, n = (
            _random_text(rng),
            [rng.randrange(1 << 20) for _ in range(rng.randrange(3))],
            rng.randrange(10**6),
        )
        whole = sse({"text": t, "output_ids": i, "meta_info": {**meta, "completion_tokens": n}})
        assert template.fill(t, i, n) == whole


@pytest.mark.parametrize(
    "choice",
    [
        lambda h: {
            "index": 3,
            "text": h,
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        },
        lambda h: {
            "index": 0,
            "delta": {"content": h},
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        },
    ],
)
@pytest.mark.parametrize("usage", [{}, {"usage": None}])
def test_an_openai_chunk_filled_equals_the_whole_chunk(  # type: ignore[no-untyped-def]
    choice, usage
) -> None:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m\u2029"}
    hole = Hole()
    template = EventTemplate({**head, "choices": [choice(hole)], **usage})
    for text in TEXTS:
        assert template.fill(text) == sse({**head, "choices": [choice(text)], **usage})


def test_a_marker_in_the_constant_parts_is_refused() -> None:
    hole = Hole()
    with pytest.raises(TemplateError):
        EventTemplate({"id": hole.marker, "text": hole})


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("usage", [(False, False), (True, False), (True, True)])
def test_templated_chunks_stream_equals_the_chunks_encoded_whole(  # type: ignore[no-untyped-def]
    kind, usage
) -> None:
    """The real completions/chat event source, with and without ``include_usage`` and
    ``continuous_usage_stats``, templated against the same chunks encoded whole; the stats
    change mid-stream (as after a retraction), so a continuous template is remade."""
    from pipeline.config import ServerConfig
    from pipeline.io_struct import RequestOutputStats, SamplingParams
    from pipeline.tokenizer_loader import load_tokenizer
    from tokenizer_proc.openai.shapes import CHAT, COMPLETION
    from tokenizer_proc.openai.stream import ChoiceEvents, StreamUsage
    from tokenizer_proc.req_state import ReqState
    from tokenizer_proc.tokenizer_manager import TokenizerManager

    tm = TokenizerManager(
        ServerConfig(scheduler_input="ipc:///unused", tokenizer_input="ipc:///unused"),
        load_tokenizer(None),
        context_length=2048,
    )
    rng = random.Random(1)
    sources = []
    for plain in (True, False):
        states = [
            ReqState(
                rid=f"r{i}", req_id=i, stream=True, sampling=SamplingParams(), created_time=0.0
            )
            for i in range(2)
        ]
        head = {"id": "cmpl-\u2028", "object": "x", "created": 1, "model": "m"}
        shape = COMPLETION if kind == "completion" else CHAT
        source = ChoiceEvents(tm, shape, states, head, StreamUsage(2, *usage))
        source._plain = plain  # the whole-encoding path, for reference
        sources.append(source)
    got: list[bytes] = [b"", b""]
    for step in range(60):
        stats = RequestOutputStats(
            prompt_tokens=9, cached_tokens=4 if step < 30 else 7, num_retractions=int(step >= 30)
        )
        texts = [_random_text(rng) for _ in range(2)]
        for side, source in enumerate(sources):
            for index, state in enumerate(source.states):
                state.request_stats = stats
                state.add_output(texts[index], [step], step + 1, float(step))
                got[side] += source.events(index)
    assert got[0] == got[1] and got[0].count(b"data: ") > 60
