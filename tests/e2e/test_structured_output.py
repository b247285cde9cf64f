"""Structured output through `splitbus up` with the official openai client: the API compiles the
grammar, P draws the first token under it, D rebuilds it from P's tokens and draws the rest (sim
engine, the module's system: one P, one D); and once with the paddle engine's masked logits."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system

PHONE = r"[0-9]{3}-[0-9]{4}"


class Person(BaseModel):
    name: str
    age: int
    tags: list[str]


def _client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, **extra: Any) -> Any:
    """A chat completion (or its stream) of "Hi", ``extra`` its other fields."""
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=400, **extra
    )


def test_json_object_and_json_schema_outputs_parse(system: System) -> None:
    client = _client(system)
    for seed in (1, 2):
        reply = _chat(client, seed=seed, response_format={"type": "json_object"})
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    parsed = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=400, seed=3, response_format=Person
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and set(json.loads(parsed.choices[0].message.content or "")) == {
        "name",
        "age",
        "tags",
    }


def test_streamed_json_schema_output_validates(system: System) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
        "required": ["ok", "size"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    chunks = list(_chat(_client(system), seed=4, response_format=rf, stream=True))
    value = json.loads("".join(c.choices[0].delta.content or "" for c in chunks))
    assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and value["size"] in ("s", "m", "l")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_guided_choice_and_regex(system: System) -> None:
    client = _client(system)
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        reply = client.completions.create(
            model="tiny", prompt="Review: ok", max_tokens=20, seed=seed, extra_body={"guided_choice": choices}
        )
        assert reply.choices[0].text in choices and reply.choices[0].finish_reason == "stop"
    phone = _chat(client, seed=5, extra_body={"guided_regex": PHONE})
    assert re.fullmatch(PHONE, phone.choices[0].message.content)


def test_a_grammar_llguidance_cannot_serve_is_a_400_naming_the_field(system: System) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        _chat(_client(system), extra_body={"guided_regex": "a(b"})
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "guided_regex" and "unclosed group" in error["message"]


def test_a_dp_group_serves_structured_output(tmp_path: Path) -> None:
    """Two DP ranks in lock-step: a constrained request and an unconstrained one share the steps."""
    system = start_system(tmp_path, "--dp", "2")
    try:
        client = _client(system)
        plain = client.completions.create(model="tiny", prompt="one", max_tokens=30, seed=4)
        assert plain.choices[0].text == sim_text(4, 30)
        reply = _chat(client, seed=6, response_format={"type": "json_object"})
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    finally:
        assert stop_system(system) == []


def test_paddle_masks_its_logits(tmp_path: Path) -> None:
    """The tiny random model draws under the mask, P then D: the output is what the grammar allows."""
    from splitbus.gpu_ops import device

    device.prepare()
    from splitbus.worker.engines.paddle.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", "llama", seed=3)
    system = start_system(tmp_path / "up", "--engine", "paddle", "--model", str(model))
    try:
        client = _client(system)
        phone = client.completions.create(
            model="tiny", prompt="Call", max_tokens=20, seed=1, extra_body={"guided_regex": PHONE}
        )
        assert re.fullmatch(PHONE, phone.choices[0].text) and phone.choices[0].finish_reason == "stop"
        choice = _chat(client, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
        assert choice.choices[0].message.content in ("yes", "no")
    finally:
        assert stop_system(system) == []
