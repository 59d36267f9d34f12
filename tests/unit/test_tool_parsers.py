"""The tool-call parsers (tokenizer_proc/parsers/hermes.py, llama3_json.py, mistral.py) hold
the contract of tokenizer_proc/parsers/tool_calls.py: canned model outputs, encoded with the
shipped tokenizer and streamed as the incremental detokenizer streams them (a character's
bytes held back until it is whole), streamed a character at a time, cut into every two
pieces and into seeded random pieces, give the content and calls of the whole output fed at
once, which are the ones each case expects. Malformed calls come back as content, never as
an exception."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.tokenizer_loader import load_tokenizer
from tokenizer_proc.parsers.forced_calls import RequiredCallsParser
from tokenizer_proc.parsers.mistral import mistral_call_id
from tokenizer_proc.parsers.tool_calls import (
    FirstCallOnly,
    ToolCall,
    ToolParseDelta,
    ToolParser,
    assemble,
    new_call_id,
    parse_whole,
)
from tokenizer_proc.parsers.tool_parsers import TOOL_PARSERS, format_call_ids, make_tool_parser

TOK = load_tokenizer(None)
TOOLS = frozenset({"get_weather", "search"})
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Case:
    id: str
    parser: str
    text: str
    content: str
    calls: tuple[tuple[str, dict[str, object]], ...] = ()
    tool_names: frozenset[str] = TOOLS


def hermes(
    id: str,
    text: str,
    content: str,
    *calls: tuple[str, dict[str, object]],
    tool_names: frozenset[str] = TOOLS,
) -> Case:
    return Case(id, "hermes", text, content, calls, tool_names)


def llama(id: str, text: str, content: str, *calls: tuple[str, dict[str, object]]) -> Case:
    return Case(id, "llama3_json", text, content, calls)


def mistral(id: str, text: str, content: str, *calls: tuple[str, dict[str, object]]) -> Case:
    return Case(id, "mistral", text, content, calls)


TRICKY_ARGS = (
    r'{"filter": {"tags": ["a", "b"], "range": [1, 2.5e3, -4]}, '
    r'"text": "brace } quote \" newline \n tag </tool_call> ]", "ok": true, "none": null}'
)
TRICKY = {
    "filter": {"tags": ["a", "b"], "range": [1, 2500.0, -4]},
    "text": 'brace } quote " newline \n tag </tool_call> ]',
    "ok": True,
    "none": None,
}

CASES = [
    # --- hermes ---
    hermes(
        "plain",
        "The capital of France is Paris.\nAnything else?",
        "The capital of France is Paris.\nAnything else?",
    ),
    hermes(
        "content_then_call",
        'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>',
        "Let me look that up.\n",
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ),
    hermes(
        "parallel",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "weather in Paris", "limit": 3}}\n'
        "</tool_call>\n",
        "",
        ("get_weather", {"city": "Paris"}),
        ("search", {"query": "weather in Paris", "limit": 3}),
    ),
    hermes(
        "tricky_arguments",
        f'<tool_call>\n{{"name": "search", "arguments": {TRICKY_ARGS}}}\n</tool_call>',
        "",
        ("search", TRICKY),
    ),
    hermes(
        "non_ascii",
        'Je vérifie… 🙂\n<tool_call>{"name": "get_weather", "arguments": {"city": "東京", '
        '"note": "café ☕ 🙂"}}</tool_call>',
        "Je vérifie… 🙂\n",
        ("get_weather", {"city": "東京", "note": "café ☕ 🙂"}),
    ),
    hermes(
        "empty_missing_and_early_arguments",
        '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>{"name": '
        '"get_weather"}</tool_call>'
        '<tool_call>{"arguments": {"query": "first"}, "name": "search"}</tool_call>'
        '<tool_call>{"name": "search", "arguments": null}</tool_call>',
        "",
        ("search", {}),
        ("get_weather", {}),
        ("search", {"query": "first"}),
        ("search", {}),
    ),
    hermes(
        "tight_then_content_after",
        '<tool_call>{"name":"search","arguments":{"query":"tight"}}</tool_call>\nI will wait for '
        "the result.",
        "\nI will wait for the result.",
        ("search", {"query": "tight"}),
    ),
    hermes(
        "any_name_without_tools",
        '<tool_call>{"name": "anything", "arguments": {"x": 1}}</tool_call>',
        "",
        ("anything", {"x": 1}),
        tool_names=frozenset(),
    ),
    hermes("not_json", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>"),
    hermes(
        "unknown_name",
        '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',
    ),
    hermes(
        "unterminated_before_name",
        'Checking <tool_call>\n{"name": "get_wea',
        'Checking <tool_call>\n{"name": "get_wea',
    ),
    hermes(
        "unterminated_after_name",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "",
        ("get_weather", {"city": "Par"}),
    ),
    hermes(
        "not_an_object",
        '<tool_call>["get_weather", {"city": "Paris"}]</tool_call>',
        '<tool_call>["get_weather", {"city": "Paris"}]</tool_call>',
    ),
    hermes(
        "no_name",
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
    ),
    hermes(
        "name_not_a_string",
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
    ),
    hermes(
        "bad_json_before_name",
        '<tool_call>{"id": 01, "name": "search"}</tool_call>',
        '<tool_call>{"id": 01, "name": "search"}</tool_call>',
    ),
    hermes(
        "raw_newline_in_name",
        '<tool_call>{"name": "sea\nrch"}</tool_call>',
        '<tool_call>{"name": "sea\nrch"}</tool_call>',
    ),
    hermes(
        "broken_after_header",
        '<tool_call>{"name": "search", "arguments": {"query": "x" oops}}</tool_call>',
        "oops}}</tool_call>",
        ("search", {"query": "x"}),
    ),
    hermes(
        "mismatched_bracket_after_header",
        '<tool_call>{"name": "search", "arguments": {"a": [1}}</tool_call>',
        "}}</tool_call>",
        ("search", {"a": [1]}),
    ),
    hermes(
        "missing_outer_brace",
        '<tool_call>{"name": "search", "arguments": {"a": 1}\n</tool_call>',
        "",
        ("search", {"a": 1}),
    ),
    hermes(
        "malformed_then_valid",
        '<tool_call>oops</tool_call>\n<tool_call>{"name": "search", "arguments": {"q": '
        "1}}</tool_call>",
        "<tool_call>oops</tool_call>\n",
        ("search", {"q": 1}),
    ),
    hermes("tag_prefix_at_end", "Hello <tool_c", "Hello <tool_c"),
    hermes("space_before_a_failed_block", " \n<tool_call>oops", " \n<tool_call>oops"),
    hermes("only_space", " \n ", " \n "),
    hermes(
        "closing_tag_missing",
        '<tool_call>{"name": "search", "arguments": {}}\n',
        "",
        ("search", {}),
    ),
    hermes(
        "closing_tag_cut",
        '<tool_call>{"name": "search", "arguments": {}}\n</tool_',
        "\n</tool_",
        ("search", {}),
    ),
    # --- llama3_json ---
    llama("plain", "Paris is the capital of France.", "Paris is the capital of France."),
    llama(
        "one_call",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        ("get_weather", {"city": "Paris"}),
    ),
    llama(
        "python_tag",
        '<|python_tag|>{"name": "search", "parameters": {"query": "llamas"}}',
        "",
        ("search", {"query": "llamas"}),
    ),
    llama(
        "separated_calls",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "search", "arguments": '
        '{"query": "Paris weather"}}',
        "",
        ("get_weather", {"city": "Paris"}),
        ("search", {"query": "Paris weather"}),
    ),
    llama(
        "leading_space_type_and_tricky",
        f'  \n{{"type": "function", "name": "search", "parameters": {TRICKY_ARGS}}}  \n',
        "",
        ("search", TRICKY),
    ),
    llama(
        "non_ascii",
        '{"name": "get_weather", "parameters": {"city": "東京 🙂"}}',
        "",
        ("get_weather", {"city": "東京 🙂"}),
    ),
    llama("json_answer_without_name", '{"answer": 42}', '{"answer": 42}'),
    llama(
        "unknown_name",
        '{"name": "delete_all", "parameters": {}}',
        '{"name": "delete_all", "parameters": {}}',
    ),
    llama("python_code", '<|python_tag|>print("hi")', '<|python_tag|>print("hi")'),
    llama("tag_prefix_at_end", "<|python_ta", "<|python_ta"),
    llama("prose_with_brace", "{curly} braces are fine", "{curly} braces are fine"),
    llama(
        "text_after_call",
        '{"name": "search", "parameters": {"query": "x"}}\nDone.',
        "\nDone.",
        ("search", {"query": "x"}),
    ),
    llama(
        "second_call_malformed",
        '{"name": "search", "parameters": {"query": "x"}}; {"name": "nope"}',
        '; {"name": "nope"}',
        ("search", {"query": "x"}),
    ),
    llama(
        "unterminated_after_name",
        '{"name": "search", "parameters": {"query": "unfini',
        "",
        ("search", {"query": "unfini"}),
    ),
    llama("unterminated_before_name", '<|python_tag|>{"nam', '<|python_tag|>{"nam'),
    # --- mistral ---
    mistral("plain", "Bonjour ! Comment puis-je aider ?", "Bonjour ! Comment puis-je aider ?"),
    mistral(
        "content_then_calls",
        'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "東京"}}, '
        '{"name": "search", "arguments": {"query": "tokyo weather"}}]',
        "Let me check. ",
        ("get_weather", {"city": "東京"}),
        ("search", {"query": "tokyo weather"}),
    ),
    mistral(
        "tricky",
        f'[TOOL_CALLS][{{"name": "search", "arguments": {TRICKY_ARGS}}}]',
        "",
        ("search", TRICKY),
    ),
    mistral(
        "empty_arguments", '[TOOL_CALLS][{"name": "search", "arguments": {}}]', "", ("search", {})
    ),
    mistral("not_json", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json"),
    mistral("marker_prefix_at_end", "Hi [TOOL_CA", "Hi [TOOL_CA"),
    mistral(
        "unknown_name",
        '[TOOL_CALLS][{"name": "delete_all", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "delete_all", "arguments": {}}]',
    ),
    mistral(
        "second_element_malformed",
        '[TOOL_CALLS][{"name": "search", "arguments": {}}, {"oops": 1}]',
        ', {"oops": 1}]',
        ("search", {}),
    ),
    mistral(
        "array_unclosed",
        '[TOOL_CALLS][{"name": "search", "arguments": {"q": "a"}}',
        "",
        ("search", {"q": "a"}),
    ),
    mistral(
        "text_after_array",
        '[TOOL_CALLS][{"name": "search", "arguments": {}}] Let me know.',
        " Let me know.",
        ("search", {}),
    ),
    mistral("space_before_a_failed_array", "\n [TOOL_CALLS] [1]", "\n [TOOL_CALLS] [1]"),
    mistral(
        "object_without_array",
        '[TOOL_CALLS]{"name": "search", "arguments": {}}',
        '[TOOL_CALLS]{"name": "search", "arguments": {}}',
    ),
]


def counting_ids() -> Callable[[], str]:
    """Deterministic ids, so that runs on different cuts give equal calls."""
    count = iter(range(1_000_000))
    return lambda: f"call_{next(count):024d}"


def run(case: Case, pieces: list[str]) -> list[ToolParseDelta]:
    parser = make_tool_parser(case.parser, case.tool_names, counting_ids())
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


def token_pieces(text: str) -> list[str]:
    """The text deltas of the tokens, as an incremental detokenizer sends them: a delta that
    ends inside a character (decoded as U+FFFD) waits for the next token."""
    ids = TOK.encode(text)
    assert TOK.decode(ids, skip_special_tokens=False) == text
    pieces, sent = [], ""
    for end in range(1, len(ids) + 1):
        decoded = TOK.decode(ids[:end], skip_special_tokens=False)
        if decoded.endswith(REPLACEMENT):
            continue
        assert decoded.startswith(sent)
        pieces.append(decoded[len(sent) :])
        sent = decoded
    assert sent == text
    return pieces


def cuts(text: str) -> Iterator[tuple[str, list[str]]]:
    yield "tokens", token_pieces(text)
    yield "characters", list(text)
    for at in range(len(text) + 1):
        yield f"two pieces at {at}", [text[:at], text[at:]]
    rng = random.Random(len(text))
    for attempt in range(5):
        points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 6)))
        yield f"random {attempt}", [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def check_first_delta_rule(deltas: list[ToolParseDelta]) -> None:
    started: set[int] = set()
    for delta in deltas:
        for call in delta.tool_calls:
            if call.index in started:
                assert call.id is None and call.name is None, call
            else:
                assert call.index == len(started), "calls start in index order"
                assert call.id is not None and call.name is not None, call
                started.add(call.index)


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}-{case.id}")
def test_whole_output_gives_the_expected_content_and_calls(case: Case) -> None:
    deltas = run(case, [case.text])
    check_first_delta_rule(deltas)
    content, calls = assemble(deltas)
    assert content == case.content
    assert [(call.name, json.loads(call.arguments)) for call in calls] == list(case.calls)


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}-{case.id}")
def test_every_cut_streams_what_the_whole_output_gives(case: Case) -> None:
    whole = assemble(run(case, [case.text]))
    for how, pieces in cuts(case.text):
        assert "".join(pieces) == case.text
        deltas = run(case, pieces)
        check_first_delta_rule(deltas)
        assert assemble(deltas) == whole, how


def test_tokens_cut_inside_markers_and_characters() -> None:
    """Guards against the token cut passing vacuously: the shipped tokenizer splits the
    markers over several tokens and holds a character's bytes back."""
    pieces = token_pieces(
        '<tool_call>{"city": "東京 🙂"}</tool_call>'  # characters of several bytes
        "[TOOL_CALLS]<|python_tag|>"
    )
    assert len(pieces) > 10
    assert not any(
        marker in piece
        for piece in pieces
        for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
    )
    assert all(REPLACEMENT not in piece for piece in pieces)


def test_arguments_stream_as_the_model_writes_them() -> None:
    parser = make_tool_parser("hermes", TOOLS, counting_ids())
    first = parser.feed('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert first.content == "Sure.\n"
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [
        (0, "get_weather", '{"city": "Pa')
    ]
    second = parser.feed('ris"}}\n</tool')
    assert [(c.index, c.id, c.name, c.arguments) for c in second.tool_calls] == [
        (0, None, None, 'ris"}')
    ]
    assert parser.feed("_call>") == ToolParseDelta(content="", tool_calls=())
    assert parser.finish() == ToolParseDelta(content="", tool_calls=())


def test_the_header_waits_for_the_whole_name() -> None:
    parser = make_tool_parser("mistral", TOOLS, counting_ids())
    assert parser.feed('[TOOL_CALLS] [{"name": "sea') == ToolParseDelta(content="", tool_calls=())
    delta = parser.feed('rch"')
    assert [(c.index, c.name, c.arguments) for c in delta.tool_calls] == [(0, "search", "")]


def test_a_marker_prefix_is_held_back_until_known() -> None:
    parser = make_tool_parser("hermes", TOOLS)
    assert parser.feed("Hello <tool_c").content == "Hello "
    assert parser.feed("ollapse").content == "<tool_collapse"
    assert parser.feed(" <tool_c").content == " "
    assert parser.finish().content == "<tool_c"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "hermes",
            '<tool_call>{"arguments": {"a": '
            + "[" * 100_000
            + "]" * 100_000
            + '}, "name": "search"}</tool_call>',
        ),
        ("hermes", '<tool_call>{"name": "search", "arguments": {"a": ' + "[" * 100_000),
        ("llama3_json", '{"name": "search", "parameters": {"a": ' + "{" * 50_000),
        ("mistral", "[TOOL_CALLS][" + "{" * 50_000),
    ],
    ids=["deep_before_name", "deep_unterminated", "deep_llama", "deep_mistral"],
)
def test_deeply_nested_json_is_no_exception(name: str, text: str) -> None:
    whole = parse_whole(make_tool_parser(name, TOOLS, counting_ids()), text)
    half = len(text) // 2
    parser = make_tool_parser(name, TOOLS, counting_ids())
    assert assemble([parser.feed(text[:half]), parser.feed(text[half:]), parser.finish()]) == whole


def test_ids_are_openai_shaped_and_distinct() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call_id) for call_id in ids)
    content, calls = parse_whole(
        make_tool_parser("hermes", TOOLS), '<tool_call>{"name": "search"}</tool_call>'
    )
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)


def test_the_registry_names_the_three_formats() -> None:
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    parser: ToolParser = make_tool_parser("llama3_json", frozenset({"f"}), counting_ids())
    assert parse_whole(parser, '{"name": "f", "parameters": {"x": [1]}}') == (
        "",
        [ToolCall(id=f"call_{0:024d}", name="f", arguments='{"x": [1]}')],
    )
    with pytest.raises(
        ValueError,
        match=r"unknown tool call parser 'qwen': expected one of hermes, llama3_json, mistral",
    ):
        make_tool_parser("qwen", TOOLS)


def test_assemble_rejects_deltas_that_break_the_first_delta_rule() -> None:
    from tokenizer_proc.parsers.tool_calls import ToolCallDelta

    headless = ToolParseDelta(
        content="", tool_calls=(ToolCallDelta(index=0, id=None, name=None, arguments="{}"),)
    )
    with pytest.raises(ValueError, match="no id or no name"):
        assemble([headless])
    head = ToolCallDelta(index=0, id="call_x", name="f", arguments="")
    with pytest.raises(ValueError, match="repeats its id or name"):
        assemble([ToolParseDelta(content="", tool_calls=(head, head))])


# Pieces of the three formats, their JSON and the ways it breaks, for the property below.
FRAGMENTS = [
    *(
        "<tool_call>",
        "</tool_call>",
        "[TOOL_CALLS]",
        "<|python_tag|>",
        '"name": ',
        '"arguments": ',
        '"parameters": ',
    ),
    *(
        '"search"',
        '"nope"',
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        "\\u00e9",
        ",",
        ":",
        ";",
        " ",
        "\n",
        "1",
        "-2.5",
        "true",
        "null",
        "x",
        "<",
        "é🙂",
    ),
]
PREFIXES = ["", "<tool_call>{", "[TOOL_CALLS][{", "<|python_tag|>{", "{"]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    parser=st.sampled_from(sorted(TOOL_PARSERS)),
    prefix=st.sampled_from(PREFIXES),
    fragments=st.lists(st.sampled_from(FRAGMENTS), max_size=30),
    points=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_any_text_streams_what_the_whole_gives_and_text_without_calls_is_content(
    parser: str, prefix: str, fragments: list[str], points: list[int]
) -> None:
    text = prefix + "".join(fragments)
    case = Case("property", parser, text, "")
    whole = assemble(run(case, [text]))
    if not whole[1]:
        assert whole[0] == text
    cut = sorted({min(point, len(text)) for point in points})
    pieces = [text[a:b] for a, b in zip([0, *cut], [*cut, len(text)])]
    deltas = run(case, pieces)
    check_first_delta_rule(deltas)
    assert assemble(deltas) == whole


REQUIRED_ANSWER = (
    '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "search", "arguments": {}}]'
)


def test_a_required_answer_cut_anywhere_gives_back_only_the_text_the_model_wrote() -> None:
    """``tool_choice: "required"`` cut by ``max_tokens``: before its first call is made the
    answer is content exactly as written (no ``[TOOL_CALLS]`` the model never wrote), after
    it the calls made so far; streamed as whole."""
    for end in range(len(REQUIRED_ANSWER) + 1):
        cut = REQUIRED_ANSWER[:end]
        content, calls = parse_whole(RequiredCallsParser(TOOLS, counting_ids()), cut)
        assert "[TOOL_CALLS]" not in content, cut
        if not calls:
            assert content == cut
        parser = RequiredCallsParser(TOOLS, counting_ids())
        deltas = [parser.feed(piece) for piece in cut] + [parser.finish()]
        check_first_delta_rule(deltas)
        assert assemble(deltas) == (content, calls), cut


TWO_HERMES_CALLS = (
    'One.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> two. '
    '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call> three.'
)


def test_first_call_only_keeps_the_first_call_and_the_parsers_content() -> None:
    """``parallel_tool_calls: false`` under "auto": one call, the first; the content is the
    format parser's (the second call's text is dropped with it); every cut streams the same."""
    whole = parse_whole(
        FirstCallOnly(make_tool_parser("hermes", TOOLS, counting_ids())), TWO_HERMES_CALLS
    )
    all_content, all_calls = parse_whole(
        make_tool_parser("hermes", TOOLS, counting_ids()), TWO_HERMES_CALLS
    )
    assert len(all_calls) == 2
    assert whole == (all_content, all_calls[:1])
    assert whole[0] == "One. two.  three."
    for how, pieces in cuts(TWO_HERMES_CALLS):
        parser = FirstCallOnly(make_tool_parser("hermes", TOOLS, counting_ids()))
        deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        check_first_delta_rule(deltas)
        assert assemble(deltas) == whole, how


def test_mistral_call_ids_are_nine_letters_and_digits_in_every_mode() -> None:
    """Mistral's templates refuse any other id when a call comes back on the next turn."""
    ids = {mistral_call_id() for _ in range(200)}
    assert len(ids) == 200 and all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in ids)
    assert format_call_ids("mistral") is mistral_call_id
    assert format_call_ids("hermes") is new_call_id
    answer = '[TOOL_CALLS][{"name": "search", "arguments": {}}]'
    [call] = parse_whole(make_tool_parser("mistral", TOOLS), answer)[1]
    assert re.fullmatch("[A-Za-z0-9]{9}", call.id)
