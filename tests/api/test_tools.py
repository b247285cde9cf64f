"""Tools in chat requests and responses (splitbus/api/tools.py), on hand-made bodies and texts: the
400s, what the template gets, the schema of a forced call, and the response fields the SSE path
and the collect path build from the same text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from splitbus.api import tool_parsers
from splitbus.api.errors import BadRequest, ContextLengthExceeded
from splitbus.api.generate import check_prompt_chars
from splitbus.api.protocol import parse_chat
from splitbus.api.tools import (
    CALL_LAYOUT,
    MAX_SCHEMA_DEPTH,
    MAX_TOOLS,
    MAX_TOOLS_CHARS,
    Choice,
    ForcedCallParser,
    ToolCallStream,
    output_schema,
    parser_for,
)
from splitbus.grammar.constraint import Constraint
from splitbus.grammar.outcomes import GrammarError
from splitbus.grammar.request import MAX_GRAMMAR_SOURCE_CHARS, compile_grammar
from splitbus.grammar.tokenizer import grammar_tokenizer
from splitbus.tokenization import ModelTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


DEEP = _nested(2000)
"""Nested past Python's recursion limit (a repr or json.dumps of it raises RecursionError)."""


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def test_tools_and_tool_choice_are_taken() -> None:
    params = parse_chat(_chat(tools=[WEATHER, TIME]))
    assert params.tools is not None and params.tools.choice is Choice.AUTO and params.tools.parallel
    assert params.tools.template_tools() == [WEATHER, TIME]  # as sent: what transformers gives the template
    named = parse_chat(_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.tools is not None and (named.tools.choice, named.tools.named) == (Choice.NAMED, "get_weather")
    required = parse_chat(_chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert required.tools is not None and required.tools.choice is Choice.REQUIRED and not required.tools.parallel
    assert parse_chat(_chat(tool_choice="none")).tools is None
    assert parse_chat(_chat(tools=[])).tools is None


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"tools": {"a": 1}}, "tools", "must be a list"),
        ({"tools": [TIME] * (MAX_TOOLS + 1)}, "tools", f"at most {MAX_TOOLS} tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", "type 'function'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name", "1 to 64"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name", "1 to 64"),
        ({"tools": [{"function": {"name": "f", "description": 3}}]}, "tools[0].function.description", "string"),
        ({"tools": [{"function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters", "schema"),
        ({"tools": [TIME, TIME]}, "tools", "twice"),
        ({"tools": [TIME], "tool_choice": "any"}, "tool_choice", "must be 'none', 'auto'"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        (
            {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": DEEP}}},
            "tool_choice",
            "not a str",
        ),
        ({"tools": [TIME], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
        ({"function_call": "auto"}, "function_call", "deprecated"),
    ],
)
def test_bad_tool_fields_are_400s_that_name_them(fields: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as caught:
        parse_chat(_chat(**fields))
    assert caught.value.param == param


def test_a_schema_nested_too_deep_or_tools_too_large_are_refused() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(BadRequest, match=f"nested at most {MAX_SCHEMA_DEPTH - 1} deep"):
        parse_chat(_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}]))
    with pytest.raises(BadRequest, match="nested at most") as caught:  # any field of the function: it is printed
        parse_chat(_chat(tools=[{"type": "function", "function": {"name": "f", "examples": deep}}]))
    assert caught.value.param == "tools[0].function.parameters"
    big = {"type": "function", "function": {"name": "f", "description": "x" * MAX_TOOLS_CHARS}}
    with pytest.raises(BadRequest, match=f"at most {MAX_TOOLS_CHARS} characters"):
        parse_chat(_chat(tools=[big]))


CONVERSATION = [
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 °C"},
]


def test_tool_messages_reach_the_template_as_transformers_expects() -> None:
    messages = parse_chat(_chat(messages=CONVERSATION, tools=[WEATHER])).messages
    assert messages is not None
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    assert messages[2] == {"role": "tool", "content": "22 °C", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "call, param",
    [
        ({"function": {"name": "f", "arguments": "{not json"}}, "messages[1].tool_calls[0].function.arguments"),
        ({"function": {"name": "f", "arguments": "[1]"}}, "messages[1].tool_calls[0].function.arguments"),
        (
            {"function": {"name": "f", "arguments": '{"a":' * 900 + "1" + "}" * 900}},
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"function": {"name": "f", "arguments": DEEP}},
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"type": "custom", "function": {"name": "f"}}, "messages[1].tool_calls[0]"),
        ({"id": 7, "function": {"name": "f"}}, "messages[1].tool_calls[0].id"),
    ],
)
def test_bad_tool_calls_in_messages_are_400s(call: dict[str, Any], param: str) -> None:
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(BadRequest) as caught:
        parse_chat(_chat(messages=messages))
    assert caught.value.param == param
    with pytest.raises(BadRequest, match="tool_call_id"):
        parse_chat(_chat(messages=[*USER, {"role": "tool", "content": "x", "tool_call_id": ["call_1"]}]))
    with pytest.raises(BadRequest, match=r"messages\[0\].name must be a string of at most 256"):
        parse_chat(_chat(messages=[{"role": "user", "content": "x", "name": "n" * 257}]))
    named = parse_chat(_chat(messages=[{"role": "user", "content": "x", "name": "ana"}], tools=[TIME]))
    assert named.messages == [{"role": "user", "content": "x", "name": "ana"}]


def test_the_prompts_character_bound_counts_the_tools_and_the_calls() -> None:
    params = parse_chat(_chat(messages=CONVERSATION, tools=[WEATHER]))
    contents = sum(len(m["content"]) for m in params.messages or [])
    tools_json = len(json.dumps([WEATHER], ensure_ascii=False))
    calls_json = len(json.dumps({"tool_calls": params.messages[1]["tool_calls"]}, ensure_ascii=False))  # type: ignore[index]
    ids_json = len(json.dumps({"tool_call_id": "call_1"}))
    total = contents + tools_json + calls_json + ids_json
    check_prompt_chars(total, params)
    with pytest.raises(ContextLengthExceeded, match=f"has {total} characters"):
        check_prompt_chars(total - 1, params)


def _stream_sum(stream: ToolCallStream, parts: list[str], reason: str) -> dict[str, Any]:
    """What a client accumulates from the deltas (as the openai SDK's helpers do)."""
    content, calls, finishes = "", {}, []
    for i, part in enumerate(parts):
        for delta, finish in stream.deltas(part, reason if i == len(parts) - 1 else None):
            finishes.append(finish)
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                slot = calls.setdefault(call["index"], {"name": "", "arguments": "", "id": None})
                slot["id"] = call.get("id", slot["id"])
                slot["name"] += call.get("function", {}).get("name", "")
                slot["arguments"] += call["function"]["arguments"]
    assert all(f is None for f in finishes[:-1])  # only the last chunk says why the output ended
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finishes[-1]}


QWEN_OUTPUT = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_streamed_deltas_add_up_to_the_non_streamed_message() -> None:
    make = parser_for(parse_chat(_chat(tools=[WEATHER, TIME])).tools, "hermes")
    choice = {"index": 0, "message": {"role": "assistant", "content": QWEN_OUTPUT}, "finish_reason": "stop"}
    whole = ToolCallStream(make).fill(choice)
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Checking."
    calls = whole["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("function", "get_weather", '{"city": "Paris"}'),
        ("function", "get_time", "{}"),
    ]
    assert all(c["id"].startswith("call_") for c in calls) and len({c["id"] for c in calls}) == 2
    streamed = _stream_sum(ToolCallStream(make), list(QWEN_OUTPUT), "stop")
    assert streamed["content"] == "Checking." and streamed["finish"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert all(c["id"].startswith("call_") for c in streamed["calls"])


def test_a_cut_output_keeps_length_and_no_parser_leaves_the_text() -> None:
    make = parser_for(parse_chat(_chat(tools=[TIME])).tools, "hermes")
    cut = _stream_sum(ToolCallStream(make), [QWEN_OUTPUT], "length")
    assert cut["finish"] == "length" and len(cut["calls"]) == 2  # calls made, then cut: length says so
    assert parser_for(parse_chat(_chat(tools=[TIME])).tools, None) is None  # no --tool-call-parser
    assert parser_for(parse_chat(_chat(tools=[TIME], tool_choice="none")).tools, "hermes") is None
    plain = _stream_sum(ToolCallStream(None), ["<tool_call>", "x"], "stop")
    assert plain == {"content": "<tool_call>x", "calls": [], "finish": "stop"}


def test_the_output_schema_of_required_and_named_calls() -> None:
    required = parse_chat(_chat(tools=[WEATHER, TIME], tool_choice="required")).tools
    schema = output_schema(required)
    assert schema is not None and schema["type"] == "array" and schema["minItems"] == 1
    weather, time = schema["items"]["anyOf"]
    assert weather["properties"] == {
        "name": {"type": "string", "const": "get_weather"},
        "arguments": WEATHER["function"]["parameters"],  # type: ignore[index]
    }
    assert time["properties"]["arguments"] == {"type": "object", "properties": {}}  # no parameters: none
    assert weather["required"] == ["name", "arguments"] and weather["additionalProperties"] is False
    one = output_schema(
        parse_chat(_chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)).tools
    )
    assert one == schema["items"]
    named = parse_chat(_chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert output_schema(named.tools) == time
    assert output_schema(parse_chat(_chat(tools=[WEATHER])).tools) is None  # auto: the parser's


def test_a_forced_call_is_read_as_its_schemas_json() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    assert tool_parsers.parse(ForcedCallParser(None), text) == (
        "",
        [tool_parsers.ToolCall("get_weather", '{"city": "Paris"}'), tool_parsers.ToolCall("get_time", "{}")],
    )
    single = '{"name": "get_time", "arguments": {}}'
    assert tool_parsers.parse(ForcedCallParser(None), single)[1] == [tool_parsers.ToolCall("get_time", "{}")]
    # Not that JSON (max_tokens cut it, or a model served without the grammar): the API's parser, else content.
    qwen = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert tool_parsers.parse(ForcedCallParser(tool_parsers.create("hermes")), qwen)[1] == [
        tool_parsers.ToolCall("get_time", "{}")
    ]
    assert tool_parsers.parse(ForcedCallParser(None), "abc") == ("abc", [])
    assert tool_parsers.parse(ForcedCallParser(None), '[{"name": "get_time"}, 3]') == ('[{"name": "get_time"}, 3]', [])


def _follows(tokenizer: ModelTokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar lets the model write ``text`` (as the worker's constraint checks it)."""
    constraint = Constraint.build(grammar_tokenizer(tokenizer), grammar)
    try:
        constraint.follow(tokenizer.encode(text))
    except GrammarError:
        return False
    return True


def test_required_and_named_calls_are_held_to_their_schemas_by_the_grammar(tiny_model: Path) -> None:
    tokenizer = ModelTokenizer.load(tiny_model)
    required = parse_chat(_chat(tools=[WEATHER, TIME], tool_choice="required"))
    assert required.grammar is not None and required.grammar.field == "tools"
    assert json.loads(required.grammar.source) == {**(output_schema(required.tools) or {}), "x-guidance": CALL_LAYOUT}
    grammar = compile_grammar(required.grammar, grammar_tokenizer(tokenizer))
    assert _follows(tokenizer, grammar, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert _follows(
        tokenizer, grammar, '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]'
    )
    assert not _follows(tokenizer, grammar, '[{"name": "get_weather", "arguments": {"city": 3}}]')  # not its schema
    assert not _follows(tokenizer, grammar, '[{"name": "get_wether", "arguments": {}}]')  # no such function
    assert not _follows(tokenizer, grammar, '{"name": "get_time", "arguments": {}}')  # parallel: a list
    assert not _follows(tokenizer, grammar, '[{"name":"get_time","arguments":{}}]')  # laid out as json.dumps does
    named = parse_chat(_chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.grammar is not None
    grammar = compile_grammar(named.grammar, grammar_tokenizer(tokenizer))
    assert _follows(tokenizer, grammar, '{"name": "get_time", "arguments": {}}')
    assert not _follows(tokenizer, grammar, '{"name": "get_weather", "arguments": {"city": "Paris"}}')


def test_auto_keeps_the_requests_own_grammar_and_a_forced_call_refuses_one() -> None:
    json_object = {"type": "json_object"}
    auto = parse_chat(_chat(tools=[TIME], response_format=json_object))
    assert auto.grammar is not None and auto.grammar.field == "response_format"
    with pytest.raises(BadRequest, match="cannot be combined with 'tool_choice'") as caught:
        parse_chat(_chat(tools=[TIME], tool_choice="required", response_format=json_object))
    assert caught.value.param == "response_format"
    described = {
        "type": "object",
        "properties": {"x": {"type": "string", "description": "x" * MAX_GRAMMAR_SOURCE_CHARS}},
    }
    long_tool = {"type": "function", "function": {"name": "f", "parameters": described}}
    assert parse_chat(_chat(tools=[long_tool])).grammar is None  # auto: no grammar, no bound but the tools'
    with pytest.raises(BadRequest, match=f"more than {MAX_GRAMMAR_SOURCE_CHARS}") as caught:
        parse_chat(_chat(tools=[long_tool], tool_choice="required"))
    assert caught.value.param == "tools"
