"""Tools through `splitbus up --tool-call-parser hermes` (sim engine, P and D), with the official
`openai` client. Left to itself the sim engine writes letters, never a call: with `auto` this
shows that a request with tools and tool messages is served through P -> D, that they reach the
model's template (its prompt's token count is the rendered prompt's, which holds the tools), and
that text with no call comes back as content. With `required` or a named function the grammar
holds the sim's draws to the calls' schema (P draws the first token under it, D the rest), so
real calls come back, streamed and not. Calls read out of free text (`auto`):
tests/api/test_tool_calls.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from splitbus.tokenization import ModelTokenizer
from splitbus.worker.engines.sim import sim_text
from tests.api.test_tool_calls import TIME, WEATHER, write_qwen_like
from tests.e2e.conftest import System, start_system, stop_system

ASKED = [{"role": "user", "content": "Weather in Paris?"}]
ANSWERED: Any = [
    *ASKED,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
]
AS_THE_TEMPLATE_SEES = [  # the assistant's call with its arguments decoded, as transformers passes it
    ANSWERED[0],
    {
        **ANSWERED[1],
        "content": "",
        "tool_calls": [
            {**ANSWERED[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    ANSWERED[2],
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen_like(tmp_path_factory.mktemp("models") / "qwen-like")


@pytest.fixture(scope="module")
def tools_system(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("up"), "--model", str(model), "--tool-call-parser", "hermes")
    yield running
    assert stop_system(running) == []


def _client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)


def _prompt_tokens(model: Path, messages: list[Any], tools: list[Any] | None) -> int:
    tokenizer = ModelTokenizer.load(model)
    rendered = tokenizer.render_chat(messages, tools=tools)
    assert all(json.dumps(tool) in rendered for tool in tools or []) and ("<tools>" in rendered) is bool(tools)
    return len(tokenizer.encode(rendered))


def test_a_chat_with_tools_is_served_and_its_prompt_holds_them(tools_system: System, model: Path) -> None:
    reply = _client(tools_system).chat.completions.create(
        model="qwen-like", messages=ASKED, tools=[WEATHER, TIME], max_tokens=12, seed=4
    )
    choice = reply.choices[0]
    assert choice.message.content == sim_text(4, 12) and choice.message.tool_calls is None
    assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.prompt_tokens == _prompt_tokens(model, ASKED, [WEATHER, TIME])
    plain = _client(tools_system).chat.completions.create(model="qwen-like", messages=ASKED, max_tokens=1, seed=4)
    assert plain.usage is not None and plain.usage.prompt_tokens == _prompt_tokens(model, ASKED, None)


def test_a_streamed_chat_with_tools_and_tool_messages(tools_system: System, model: Path) -> None:
    chunks = list(
        _client(tools_system).chat.completions.create(
            model="qwen-like",
            messages=ANSWERED,
            tools=[WEATHER],
            tool_choice="auto",
            max_tokens=9,
            seed=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == sim_text(8, 9)
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == _prompt_tokens(model, AS_THE_TEMPLATE_SEES, [WEATHER])


def test_tool_choice_none_and_a_bad_tool_call_message(tools_system: System) -> None:
    reply = _client(tools_system).chat.completions.create(
        model="qwen-like", messages=ANSWERED, tools=[WEATHER], tool_choice="none", max_tokens=5, seed=2
    )
    assert reply.choices[0].message.content == sim_text(2, 5) and reply.choices[0].finish_reason == "length"
    broken = [*ASKED, {**ANSWERED[1], "tool_calls": [{"function": {"name": "get_weather", "arguments": "{"}}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        _client(tools_system).chat.completions.create(model="qwen-like", messages=broken, tools=[WEATHER])
    assert caught.value.body["param"] == "messages[1].tool_calls[0].function.arguments"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_every_tokens_logprobs_come_back_with_a_parser_reading_the_text(tools_system: System, stream: bool) -> None:
    """The hermes parser holds back text that may begin a tag (the sim's spaces): the logprobs of
    its tokens still come back, once each and in order."""
    asked: Any = {"model": "qwen-like", "messages": ASKED, "tools": [WEATHER], "max_tokens": 20, "seed": 3}
    client = _client(tools_system)
    if stream:
        chunks = list(client.chat.completions.create(**asked, logprobs=True, top_logprobs=2, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        items = [i for c in chunks if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content or []]
    else:
        reply = client.chat.completions.create(**asked, logprobs=True, top_logprobs=2)
        text = reply.choices[0].message.content or ""
        items = (reply.choices[0].logprobs.content if reply.choices[0].logprobs else None) or []
    assert text == sim_text(3, 20) and " " in text
    assert "".join(i.token for i in items) == text and all(len(i.top_logprobs) == 2 for i in items)


def _arguments_fit(name: str, arguments: str) -> None:
    """The call names a tool and its arguments parse and match that tool's parameters."""
    value = json.loads(arguments)
    assert name in ("get_weather", "get_time") and isinstance(value, dict)
    if name == "get_weather":
        assert isinstance(value["city"], str)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_calls_are_held_to_the_tools_schemas(tools_system: System, seed: int) -> None:
    reply = _client(tools_system).chat.completions.create(
        model="qwen-like", messages=ASKED, tools=[WEATHER, TIME], tool_choice="required", max_tokens=400, seed=seed
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for call in calls:
        _arguments_fit(call.function.name, call.function.arguments)  # type: ignore[union-attr]
    single = _client(tools_system).chat.completions.create(
        model="qwen-like",
        messages=ASKED,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=400,
        seed=seed,
    )
    assert len(single.choices[0].message.tool_calls or []) == 1 and single.choices[0].finish_reason == "tool_calls"


def test_a_named_call_streams_as_tool_call_deltas(tools_system: System) -> None:
    chunks = list(
        _client(tools_system).chat.completions.create(
            model="qwen-like",
            messages=ANSWERED,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=400,
            seed=6,
            stream=True,
        )
    )
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0} and deltas[0].id is not None and deltas[0].id.startswith("call_")
    name = "".join(d.function.name or "" for d in deltas if d.function)
    _arguments_fit(name, "".join(d.function.arguments or "" for d in deltas if d.function))
    assert name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


class GetWeather(BaseModel):
    city: str
    days: int


def test_the_sdks_parse_reads_a_pydantic_tools_arguments(tools_system: System) -> None:
    reply = _client(tools_system).chat.completions.parse(
        model="qwen-like",
        messages=ASKED,  # type: ignore[arg-type]
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        max_tokens=400,
        seed=5,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert json.loads(call.function.arguments) == call.function.parsed_arguments.model_dump()


def test_paddle_writes_calls_that_match_under_the_grammar(tmp_path: Path) -> None:
    """The tiny random model, P then D, its logits masked by the call's grammar: a named call comes
    back whole and matching, streamed and not."""
    from splitbus.gpu_ops import device

    device.prepare()
    from splitbus.worker.engines.paddle.tiny import make_tiny_model

    # No other key allowed: the random model's call then ends after "unit" whatever the seed draws
    # (with extra keys allowed it wandered into them until max_tokens for some seeds).
    unit = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    tool: Any = {"type": "function", "function": {"name": "set_unit", "parameters": unit}}
    named: Any = {"type": "function", "function": {"name": "set_unit"}}
    model = make_tiny_model(tmp_path / "tiny", "llama", seed=3)
    system = start_system(tmp_path / "up", "--engine", "paddle", "--model", str(model))
    try:
        client = _client(system)
        reply = client.chat.completions.create(
            model="tiny", messages=ASKED, tools=[tool], tool_choice=named, max_tokens=60, seed=1
        )
        (call,) = reply.choices[0].message.tool_calls or []
        assert call.function.name == "set_unit" and reply.choices[0].finish_reason == "tool_calls"  # type: ignore[union-attr]
        assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")  # type: ignore[union-attr]
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=ASKED, tools=[tool], tool_choice=named, max_tokens=60, seed=1, stream=True
            )
        )
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        assert arguments == call.function.arguments  # type: ignore[union-attr]  # the same seed: the same call
    finally:
        assert stop_system(system) == []


def test_forced_calls_through_dp_groups_of_p_and_d(model: Path, tmp_path: Path) -> None:
    """P and D each a DP group of two ranks: the call's grammar goes with the request to whichever
    rank takes it, and the calls come back whole and matching, streamed and not."""
    system = start_system(tmp_path, "--model", str(model), "--prefill-dp", "2", "--decode-dp", "2")
    try:
        client = _client(system)
        for seed in (1, 2):
            forced: Any = {"model": "qwen-like", "messages": ASKED, "tools": [WEATHER, TIME], "seed": seed}
            reply = client.chat.completions.create(**forced, tool_choice="required", max_tokens=400)
            calls = reply.choices[0].message.tool_calls or []
            assert calls and reply.choices[0].finish_reason == "tool_calls"
            for call in calls:
                _arguments_fit(call.function.name, call.function.arguments)  # type: ignore[union-attr]
            chunks = list(client.chat.completions.create(**forced, tool_choice="required", max_tokens=400, stream=True))
            deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
            names = [
                "".join(d.function.name or "" for d in deltas if d.index == i and d.function) for i in range(len(calls))
            ]
            assert names == [c.function.name for c in calls]  # type: ignore[union-attr]  # the same seed, the same calls
    finally:
        assert stop_system(system) == []
