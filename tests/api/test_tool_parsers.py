"""Tool-call parsers (splitbus/api/tool_parsers.py) on whole texts and on every split of them: the
pieces a stream decides add up to the whole text's parse, wherever the text was cut."""

from __future__ import annotations

import json

import pytest

from splitbus.api import tool_parsers
from splitbus.api.tool_parsers import HermesParser, Piece, ToolCall, ToolParser, UnknownParser, parse

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "°C"}, ensure_ascii=False))
TIME = ToolCall("get_time", "{}")
QWEN_TWO_CALLS = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)
HERMES_CASES = [
    (QWEN_TWO_CALLS, "Let me check.", [WEATHER, TIME]),
    ("No tools needed.\n", "No tools needed.\n", []),  # no call: the text as it is, whitespace kept
    ("Cut at <tool_", "Cut at <tool_", []),  # a partial tag that never completes is text
    ('a <tool_call>{"name": "get_time"}</tool_call> b', "ab", [TIME]),  # no arguments: {}
    ('<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', "", [TIME]),  # quoted arguments
    ('x <tool_call>{"name": oops}</tool_call> y', 'x <tool_call>{"name": oops}</tool_call> y', []),  # verbatim
    ('<tool_call>{"name": "get_time", "arguments": {}}', "", [TIME]),  # left open at the end, but complete
    ('<tool_call>{"name": "get_time", "argu', '<tool_call>{"name": "get_time", "argu', []),  # cut by max_tokens
    ('<tool_call>["get_time"]</tool_call>', '<tool_call>["get_time"]</tool_call>', []),  # not a call object
]
LLAMA_CASES = [
    ('<|python_tag|>{"name": "get_time", "parameters": {}}', "", [TIME]),
    (
        ' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}; '
        '{"name": "get_time", "arguments": {}}',
        "",
        [WEATHER, TIME],
    ),
    ("The answer is {x}.", "The answer is {x}.", []),  # not starting with a call: content
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ('{"name": "get_time", "parameters": {}} and then', "and then", [TIME]),  # what follows the calls
    ('{"name": "get_time", "parameters": {}}; {"x": 1}', '{"x": 1}', [TIME]),
    ('{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', []),  # cut
    ("<|python", "<|python", []),
]


def _pieces_of(parser: ToolParser, parts: list[str]) -> tuple[str, list[ToolCall]]:
    pieces: list[Piece] = []
    for part in parts:
        pieces += parser.feed(part)
    pieces += parser.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]


def _every_split(text: str) -> list[list[str]]:
    """The text in two parts at every boundary, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_whole_and_streamed(text: str, content: str, calls: list[ToolCall]) -> None:
    assert parse(tool_parsers.create("hermes"), text) == (content, calls)
    for parts in _every_split(text):
        assert _pieces_of(tool_parsers.create("hermes"), parts) == (content, calls), parts


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json_whole_and_streamed(text: str, content: str, calls: list[ToolCall]) -> None:
    assert parse(tool_parsers.create("llama3_json"), text) == (content, calls)
    for parts in _every_split(text):
        assert _pieces_of(tool_parsers.create("llama3_json"), parts) == (content, calls), parts


def test_content_before_a_call_streams_before_the_call_completes() -> None:
    parser = tool_parsers.create("hermes")
    assert parser.feed("Let me check") == ["Let me check"]
    assert parser.feed(".\n<tool") == ["."]  # the newline and the partial tag wait
    assert parser.feed('_call>{"name": "get_time", ') == []
    assert parser.feed('"arguments": {}}</tool_call>') == [TIME]
    assert parser.finish() == []


def test_a_llama3_call_is_sent_once_its_json_closes() -> None:
    parser = tool_parsers.create("llama3_json")
    assert parser.feed('{"name": "get_time", "parameters": {}') == []
    assert parser.feed("}") == [TIME]
    assert parser.feed("; {") == []
    assert parser.feed("oops") == []  # might still be a call
    assert parser.finish() == ["; {oops"]  # it was not: text, as written


def test_the_registry_names_its_parsers_and_refuses_unknown_ones() -> None:
    assert {"hermes", "llama3_json"} <= set(tool_parsers.names())
    assert isinstance(tool_parsers.create("hermes"), HermesParser)
    with pytest.raises(UnknownParser, match="no tool-call parser is named 'mistral'.*hermes"):
        tool_parsers.create("mistral")
    with pytest.raises(ValueError, match="two tool-call parsers are named 'hermes'"):
        tool_parsers.register("hermes")(type("Other", (HermesParser,), {}))


def test_a_call_nested_past_the_encoders_depth_is_text() -> None:
    deep = '{"a": ' * 2000 + "1" + "}" * 2000
    text = '<tool_call>{"name": "f", "arguments": ' + deep + "}</tool_call>"
    assert parse(tool_parsers.create("hermes"), text) == (text, [])
    assert parse(tool_parsers.create("llama3_json"), '{"name": "f", "parameters": ' + deep + "}")[1] == []
