"""Tools through a live `splitbus api --tool-call-parser hermes`, with the official `openai` client:
the tools and tool messages reach the model's template (Qwen2.5's), and the calls a model writes
(the scripted responder says them, one character a token) come back as the SDK's typed
``tool_calls``, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.redis_server import EmbeddedRedis
from splitbus.tokenization import ModelTokenizer
from splitbus.tokenization.byte_level import write_byte_level_tokenizer
from tests.api.conftest import CONTEXT, ApiProcess, running_api
from tests.api.responder import Responder
from tests.tokenization.test_chat_template import QWEN25_TOOLS

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALLS = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def write_qwen_like(folder: Path) -> Path:
    """A tokenizer-only model folder: the byte-level test tokenizer with Qwen2.5's chat template
    (it prints the tools), a context of 4 x CONTEXT."""
    write_byte_level_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN25_TOOLS}))
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": CONTEXT * 4})
    )
    return folder


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen_like(tmp_path_factory.mktemp("models") / "qwen-like")


@pytest.fixture(scope="module")
def scripted(redis_server: EmbeddedRedis, qwen_like: Path, prefix: str) -> Iterator[Responder]:
    responder = Responder(
        BusConfig(redis_url=redis_server.url, prefix=prefix), ModelTokenizer.load(qwen_like), "qwen-like"
    )
    yield responder.start()
    responder.stop()


@pytest.fixture(scope="module")
def hermes_api(redis_server: EmbeddedRedis, qwen_like: Path, prefix: str, scripted: Responder) -> Iterator[ApiProcess]:
    yield from running_api(redis_server.url, prefix, [qwen_like], "--tool-call-parser", "hermes")


def _client(api: ApiProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.v1, api_key="unused", max_retries=0, timeout=30)


def _say(text: str) -> list[Any]:
    return [{"role": "user", "content": f"[say]{text}[/say]"}]


def test_calls_come_back_as_typed_tool_calls(hermes_api: ApiProcess) -> None:
    reply = _client(hermes_api).chat.completions.create(
        model="qwen-like", messages=_say(CALLS), tools=[WEATHER, TIME], max_tokens=300
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls or []
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_time", {}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2


def test_streamed_calls_arrive_as_tool_call_deltas(hermes_api: ApiProcess) -> None:
    stream = _client(hermes_api).chat.completions.create(
        model="qwen-like", messages=_say(CALLS), tools=[WEATHER, TIME], max_tokens=300, stream=True
    )
    content, calls, finishes = "", {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finishes.append(chunk.choices[0].finish_reason)
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            assert call.function is not None
            slot["name"] += call.function.name or ""
            slot["arguments"] += call.function.arguments or ""
    assert content == "Checking." and [f for f in finishes if f] == ["tool_calls"] and finishes[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_choice_none_leaves_the_text(hermes_api: ApiProcess) -> None:
    reply = _client(hermes_api).chat.completions.create(
        model="qwen-like", messages=_say(CALLS), tools=[WEATHER], tool_choice="none", max_tokens=300
    )
    assert reply.choices[0].message.content == CALLS and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


def test_the_template_gets_the_tools_and_the_tool_messages(hermes_api: ApiProcess, scripted: Responder) -> None:
    messages: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "[say]It is 22 C.[/say]"},
    ]
    reply = _client(hermes_api).chat.completions.create(
        model="qwen-like", messages=messages, tools=[WEATHER], max_tokens=50
    )
    assert reply.choices[0].message.content == "It is 22 C." and reply.choices[0].finish_reason == "stop"
    (request,) = [r for r in scripted.requests if r.request_id == reply.id]
    prompt = scripted.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' in prompt
    assert "<|im_start|>user\n<tool_response>\n[say]It is 22 C.[/say]\n</tool_response><|im_end|>" in prompt


def test_a_named_function_not_in_tools_is_a_400(hermes_api: ApiProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _client(hermes_api).chat.completions.create(
            model="qwen-like",
            messages=_say("x"),
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
    assert caught.value.status_code == 400 and "get_time" in caught.value.message
    assert caught.value.body["param"] == "tool_choice"  # type: ignore[index]


@pytest.fixture(scope="module")
def llama_api(redis_server: EmbeddedRedis, qwen_like: Path, prefix: str, scripted: Responder) -> Iterator[ApiProcess]:
    yield from running_api(redis_server.url, prefix, [qwen_like], "--tool-call-parser", "llama3_json")


def test_the_llama3_json_parser_reads_bare_json_calls(llama_api: ApiProcess) -> None:
    said = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    reply = _client(llama_api).chat.completions.create(
        model="qwen-like", messages=_say(said), tools=[WEATHER, TIME], max_tokens=300
    )
    calls = reply.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert reply.choices[0].message.content is None and reply.choices[0].finish_reason == "tool_calls"
    text = _client(llama_api).chat.completions.create(
        model="qwen-like", messages=_say("It is sunny."), tools=[WEATHER], max_tokens=300
    )
    assert text.choices[0].message.content == "It is sunny." and text.choices[0].message.tool_calls is None
