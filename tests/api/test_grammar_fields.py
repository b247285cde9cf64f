"""Structured-output fields in the API: parsed with the body, compiled before admission (a 400
naming the field), carried to the bus in the request's sampling parameters. Hand-made bodies,
no server (the served path: tests/e2e/test_structured_output.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import Tokenizer

from splitbus.api.errors import BadRequest
from splitbus.api.generate import Generation, request_grammar
from splitbus.api.protocol import parse_chat, parse_completion
from splitbus.grammar.request import GrammarFormat
from splitbus.tokenization import ModelTokenizer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


class Inline:
    """An ApiState whose pool runs the work at once."""

    async def off_loop(self, work: Callable[[], Any]) -> Any:
        return work()


def test_both_endpoints_take_the_fields() -> None:
    chat = parse_chat({**CHAT, "response_format": {"type": "json_object"}})
    assert chat.grammar is not None and chat.grammar.field == "response_format"
    completion = parse_completion({"model": "m", "prompt": "x", "guided_choice": ["a", "b"]})
    assert completion.grammar is not None and completion.grammar.format is GrammarFormat.CHOICE
    assert parse_chat({**CHAT, "response_format": {"type": "text"}}).grammar is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex"),
    ],
)
def test_a_malformed_field_is_a_400_naming_it(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as raised:
        parse_chat({**CHAT, **extra})
    assert raised.value.param == param and raised.value.status == 400


async def test_an_unsupported_grammar_is_a_400_before_admission(tiny_model: Path) -> None:
    tokenizer = ModelTokenizer.load(tiny_model)
    params = parse_chat({**CHAT, "guided_json": {"type": "object", "dependentSchemas": {"a": {}}}})
    with pytest.raises(BadRequest) as raised:
        await request_grammar(Inline(), tokenizer, params.grammar, "chatcmpl-1")  # type: ignore[arg-type]
    error = raised.value
    assert (error.param, error.code) == ("guided_json", "invalid_grammar")
    assert "dependentSchemas" in error.message and "chatcmpl-1" in error.message
    assert await request_grammar(Inline(), tokenizer, None) is None  # type: ignore[arg-type]


async def test_the_compiled_grammar_travels_in_the_bus_message(tiny_model: Path) -> None:
    tokenizer = ModelTokenizer.load(tiny_model)
    params = parse_completion({"model": "m", "prompt": "x", "guided_regex": "[0-9]+"})
    grammar = await request_grammar(Inline(), tokenizer, params.grammar)  # type: ignore[arg-type]
    assert grammar is not None and "[0-9]+" in grammar
    reader = SimpleNamespace(reader_of=lambda request_id: "api-1.out.0")
    state = SimpleNamespace(config=SimpleNamespace(request_timeout_s=60, node_id="api-1"), reader=reader)
    message = Generation(state, params, [1], 8, grammar=grammar).message()  # type: ignore[arg-type]
    assert message.sampling.grammar == grammar
    assert Generation(state, params, [1], 8).message().sampling.grammar is None  # type: ignore[arg-type]


async def test_a_model_whose_tokenizer_llguidance_cannot_read_answers_400(tiny_model: Path) -> None:
    undecodable = ModelTokenizer.load(tiny_model)
    config = json.loads(undecodable.tokenizer.to_str())
    undecodable.tokenizer = Tokenizer.from_str(json.dumps({**config, "decoder": None}))
    params = parse_chat({**CHAT, "guided_choice": ["a", "b"]})
    with pytest.raises(BadRequest) as raised:
        await request_grammar(Inline(), undecodable, params.grammar)  # type: ignore[arg-type]
    assert raised.value.param == "guided_choice" and "cannot read the tokenizer" in raised.value.message
