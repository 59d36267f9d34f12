"""The reasoning parsers (tokenizer_proc/parsers/reasoning.py) on real tokenizers.

Splitting: outputs are encoded, streamed as the incremental detokenizer streams them (a
character's bytes held back until it is whole), cut into rows of 1, 2 and 3 tokens and into
every two pieces, and every cut must split like the whole output fed at once, with the same
span. Counting: ``count_reasoning_tokens`` against the ids, on two tokenizers: the shipped
one, where ``<think>`` is several tokens, and the same with ``<think>``/``</think>`` added as
single tokens, as Qwen3's tokenizer has them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from tokenizers import AddedToken, Tokenizer

from pipeline.token_texts import TokenTextCache
from pipeline.tokenizer_loader import load_tokenizer
from tokenizer_proc.openai.chat_parsing import ChatParsing
from tokenizer_proc.openai.tools import ChatTool, FunctionDefinition, plan_tools
from tokenizer_proc.parsers.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ThinkTags,
    count_reasoning_tokens,
    make_reasoning_parser,
)

START, END = "<think>", "</think>"
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Case:
    name: str
    dialect: str
    output: str
    reasoning: str
    content: str
    enable_thinking: bool = True


MULTILINE = "Première étape : 日本語を考える 🤔\nZweite Zeile — ça marche\n"
TOOL_CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'

CASES = [
    Case("r1_both_tags", "deepseek_r1", "<think>abc</think>answer", "abc", "answer"),
    Case("r1_prompt_opened", "deepseek_r1", "abc</think>answer", "abc", "answer"),
    Case(
        "r1_multiline_non_ascii",
        "deepseek_r1",
        MULTILINE + "</think>\n\nRéponse : 42 ✓",
        MULTILINE,
        "\n\nRéponse : 42 ✓",
    ),
    Case("r1_empty_reasoning", "deepseek_r1", "<think></think>answer", "", "answer"),
    Case(
        "r1_no_tags_all_reasoning",
        "deepseek_r1",
        "still thinking, é 日",
        "still thinking, é 日",
        "",
    ),
    Case(
        "r1_tool_call_in_reasoning",
        "deepseek_r1",
        f"maybe {TOOL_CALL} no</think>{TOOL_CALL}",
        f"maybe {TOOL_CALL} no",
        TOOL_CALL,
    ),
    Case("r1_partial_end_tag_at_end", "deepseek_r1", "abc</thi", "abc</thi", ""),
    Case("r1_partial_start_tag_only", "deepseek_r1", "<thi", "<thi", ""),
    Case("r1_second_end_tag_is_content", "deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    Case("qwen3_both_tags", "qwen3", "<think>abc</think>answer", "abc", "answer"),
    Case("qwen3_prompt_opened", "qwen3", "abc</think>answer", "abc", "answer"),
    Case(
        "qwen3_multiline_non_ascii",
        "qwen3",
        f"<think>{MULTILINE}</think>\n\nRéponse ✓",
        MULTILINE,
        "\n\nRéponse ✓",
    ),
    Case("qwen3_empty_reasoning", "qwen3", "<think></think>answer", "", "answer"),
    Case("qwen3_no_tags_all_content", "qwen3", "plain answer, é 日", "", "plain answer, é 日"),
    Case(
        "qwen3_tool_call_in_reasoning",
        "qwen3",
        f"<think>maybe {TOOL_CALL}</think>{TOOL_CALL}",
        f"maybe {TOOL_CALL}",
        TOOL_CALL,
    ),
    Case("qwen3_partial_end_tag_in_reasoning", "qwen3", "<think>abc</thi", "abc</thi", ""),
    Case("qwen3_partial_end_tag_in_content", "qwen3", "answer </thi", "", "answer </thi"),
    Case("qwen3_cut_off_while_thinking", "qwen3", "<think>only thinking", "only thinking", ""),
    Case("qwen3_late_start_tag_is_text", "qwen3", "\n<think>abc</think>x", "\n<think>abc", "x"),
    Case(
        "qwen3_thinking_off",
        "qwen3",
        "<think>abc</think>answer",
        "",
        "<think>abc</think>answer",
        enable_thinking=False,
    ),
]


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    return load_tokenizer(None).tokenizer


@pytest.fixture(scope="module")
def tagged(shipped: Tokenizer) -> Tokenizer:
    tokenizer = Tokenizer.from_str(shipped.to_str())
    tokenizer.add_tokens(
        [
            AddedToken(START, special=False, normalized=False),
            AddedToken(END, special=False, normalized=False),
        ]
    )
    return tokenizer


def token_deltas(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each token's text delta as an incremental detokenizer sends it: held while the decode
    ends in an unfinished character, released whole at the last token."""
    deltas, sent = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        if text.endswith(REPLACEMENT) and i < len(ids) - 1:
            deltas.append("")
            continue
        assert text.startswith(sent)
        deltas.append(text[len(sent) :])
        sent = text
    return deltas


def cuts(deltas: list[str]) -> Iterator[tuple[str, list[str]]]:
    """Rows of 1, 2 and 3 tokens, and every cut into two pieces."""
    for size in (1, 2, 3):
        yield (
            f"rows of {size}",
            ["".join(deltas[i : i + size]) for i in range(0, len(deltas), size)],
        )
    for at in range(1, len(deltas)):
        yield f"cut at {at}", ["".join(deltas[:at]), "".join(deltas[at:])]


Parsed = tuple[str, str, tuple[int, int] | None]


def parse(parser: ReasoningParser, rows: list[str]) -> Parsed:
    reasoning, content = [], []
    for text in rows:
        delta = parser.feed(text)
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    last = parser.finish()
    return "".join(reasoning) + last.reasoning, "".join(content) + last.content, parser.span


def fresh(case: Case) -> ReasoningParser:
    return make_reasoning_parser(case.dialect, enable_thinking=case.enable_thinking)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def expected_span(case: Case) -> tuple[int, int] | None:
    """Where the reasoning text lies in the output, read off the case by the dialect's rules."""
    out = case.output
    if case.dialect == "qwen3" and not case.enable_thinking:
        return None
    begin = len(START) if out.startswith(START) else 0
    end = out.find(END, begin)
    if end >= 0:
        return begin, end
    opened = begin > 0 or case.dialect == "deepseek_r1"
    return (begin, len(out)) if opened else None


@pytest.mark.parametrize("tokenizer_name", ["shipped", "tagged"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_stream_splits_like_the_whole_output(
    case: Case, tokenizer_name: str, request: pytest.FixtureRequest
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(tokenizer_name)
    deltas = token_deltas(tokenizer, encode(tokenizer, case.output))
    assert "".join(deltas) == case.output

    whole = parse(fresh(case), [case.output])
    assert whole == (case.reasoning, case.content, expected_span(case))
    span = whole[2]
    if span is not None:
        assert case.output[span[0] : span[1]] == case.reasoning
    for name, rows in cuts(deltas):
        assert parse(fresh(case), rows) == whole, name


def token_bytes(tokenizer: Tokenizer, ids: list[int], text: str) -> list[bytes]:
    cache = TokenTextCache(tokenizer)
    raw = [cache.raw(i) for i in ids]
    assert b"".join(raw) == text.encode()
    return raw


def test_added_tag_tokens_have_their_text_as_bytes(tagged: Tokenizer) -> None:
    cache = TokenTextCache(tagged)
    ids = [encode(tagged, tag) for tag in (START, END)]
    assert all(len(tag_ids) == 1 for tag_ids in ids)
    assert [cache.raw(tag_ids[0]) for tag_ids in ids] == [b"<think>", b"</think>"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_count_is_the_ids_between_single_token_tags(case: Case, tagged: Tokenizer) -> None:
    ids = encode(tagged, case.output)
    start_id, end_id = tagged.token_to_id(START), tagged.token_to_id(END)
    span = parse(fresh(case), [case.output])[2]

    # The ids strictly between the tag ids, found in the id list.
    begin = 1 if ids[:1] == [start_id] else 0
    if span is None:
        expected = 0
    elif end_id in ids[begin:]:
        expected = ids.index(end_id, begin) - begin
    else:
        expected = len(ids) - begin
    assert (
        count_reasoning_tokens(token_bytes(tagged, ids, case.output), case.output, span) == expected
    )
    assert expected == (len(encode(tagged, case.reasoning)) if span is not None else 0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_count_is_the_tokens_overlapping_the_reasoning_bytes(
    case: Case, shipped: Tokenizer
) -> None:
    ids = encode(shipped, case.output)
    raw = token_bytes(shipped, ids, case.output)
    span = parse(fresh(case), [case.output])[2]

    reasoning_bytes: set[int] = set()
    if span is not None:
        first = len(case.output[: span[0]].encode())
        reasoning_bytes = set(range(first, first + len(case.reasoning.encode())))
    overlapping, at = 0, 0
    for piece in raw:
        overlapping += bool(reasoning_bytes & set(range(at, at + len(piece))))
        at += len(piece)
    assert count_reasoning_tokens(raw, case.output, span) == overlapping


BOUNDARY_REASONINGS = {
    "ascii": "abc def",
    "empty": "",
    "e_acute": "é",
    "cjk_emoji": "日本語を考える 🤔",
    "multiline": MULTILINE,
}


@pytest.mark.parametrize("reasoning", BOUNDARY_REASONINGS.values(), ids=BOUNDARY_REASONINGS.keys())
@pytest.mark.parametrize("dialect", REASONING_PARSERS)
def test_count_is_exact_when_the_tags_fall_on_token_boundaries(
    dialect: str, reasoning: str, shipped: Tokenizer
) -> None:
    opening = [START] if dialect == "qwen3" else []  # R1's prompt opens the reasoning
    parts = [*opening, reasoning, END, "\n\nanswer ✓"]
    ids = [i for part in parts for i in encode(shipped, part)]
    text = shipped.decode(ids, skip_special_tokens=False)
    parser = make_reasoning_parser(dialect)
    got = parse(parser, token_deltas(shipped, ids))
    assert got[0] == reasoning
    assert count_reasoning_tokens(token_bytes(shipped, ids, text), text, got[2]) == len(
        encode(shipped, reasoning)
    )


def test_count_by_bytes_on_hand_made_tokens() -> None:
    text = "<think>é</think>x"
    span = (7, 8)
    # A character's bytes in two tokens both count; so do skipped tokens inside, the first byte
    # included.
    assert (
        count_reasoning_tokens(
            [b"<think>", b"", b"\xc3", b"", b"\xa9", b"</think>", b"", b"x"], text, span
        )
        == 4
    )
    # Tokens straddling the tags' edges count; a skipped token at the end tag does not.
    assert (
        count_reasoning_tokens([b"<thi", b"nk>\xc3", b"\xa9</", b"", b"think>x"], text, span) == 2
    )
    assert count_reasoning_tokens([text.encode()], text, span) == 1
    # An empty reasoning has no bytes to overlap, even inside a token; no reasoning counts nothing.
    assert count_reasoning_tokens([b"<think></think>x"], "<think></think>x", (7, 7)) == 0
    assert count_reasoning_tokens([b"abc", b""], "abc", None) == 0


def test_count_with_non_ascii_tags_goes_by_bytes(shipped: Tokenizer) -> None:
    think = ThinkTags("«思»", "«/思»")
    ids = [i for part in [think.start, "é日 ok", think.end, "x"] for i in encode(shipped, part)]
    text = shipped.decode(ids, skip_special_tokens=False)
    parser = make_reasoning_parser("qwen3", think=think)
    reasoning, content, span = parse(parser, token_deltas(shipped, ids))
    assert (reasoning, content, span) == ("é日 ok", "x", (3, 8))
    assert count_reasoning_tokens(token_bytes(shipped, ids, text), text, span) == len(
        encode(shipped, "é日 ok")
    )


def test_undecided_qwen3_output_is_held_until_the_end_tag() -> None:
    parser = make_reasoning_parser("qwen3")
    assert parser.feed("abc") == parser.feed(" def") == parser.feed("")
    delta = parser.feed("</think>x")
    assert (delta.reasoning, delta.content) == ("abc def", "x")
    parser.finish()
    assert parser.span == (0, 7)


def test_thinking_off_ignored_by_deepseek_r1() -> None:
    parser = make_reasoning_parser("deepseek_r1", enable_thinking=False)
    assert parse(parser, ["abc</think>x"]) == ("abc", "x", (0, 3))


def test_unknown_parser_name_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        make_reasoning_parser("qwen2")
    assert REASONING_PARSERS == ("deepseek_r1", "qwen3")


def test_feed_after_finish_and_span_before_finish_are_refused() -> None:
    parser = make_reasoning_parser("qwen3")
    with pytest.raises(RuntimeError, match="before finish"):
        _ = parser.span
    parser.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        parser.feed("x")


def test_a_tool_call_inside_reasoning_is_reasoning_not_a_call() -> None:
    """A chat answer read for tools under "auto" with a reasoning parser: the tool parser sees
    only the content the reasoning parser leaves."""
    tools = [ChatTool(type="function", function=FunctionDefinition(name="f"))]
    parsing = ChatParsing(plan_tools(tools, None, None), "hermes", "qwen3")
    splitter = parsing.splitter()
    whole = splitter.feed(f"{START}{TOOL_CALL}{END}ok") + splitter.finish()
    assert (whole.reasoning, whole.content, whole.tool_calls) == (TOOL_CALL, "ok", ())
    assert splitter.calls == []


def test_count_with_broken_utf8_in_the_reasoning_goes_by_the_raw_bytes() -> None:
    """A model can write a broken UTF-8 sequence (here the first two bytes of a three-byte
    character, then ASCII): the text shows one U+FFFD for them, three bytes where the tokens
    have two, and the count must still stop at the end tag."""
    tokens = [b" a\xe4\xb8\x96\xe7\x95", b"e", b"b", b"</think>", b"ok"]
    text = b"".join(tokens).decode("utf-8", "replace")
    assert text == " a\u4e16\ufffdeb</think>ok"
    assert count_reasoning_tokens(tokens, text, (0, text.index("</think>"))) == 3
    # A broken sequence right before the tag, and one at the very end of the output.
    tokens = [b"x\xe7\x95", b"</think>", b"y\xe7"]
    text = b"".join(tokens).decode("utf-8", "replace")
    assert count_reasoning_tokens(tokens, text, (0, text.index("</think>"))) == 1
    assert count_reasoning_tokens(tokens, text, (0, len(text))) == 3
