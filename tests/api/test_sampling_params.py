"""The sampling parameters applied to the logits (penalties, logit_bias, min_tokens, min_p,
stop_token_ids): parsed as OpenAI and vLLM take them, refused with a 400 naming the field and
its limit, and carried on the bus to the workers; and stream_options.include_usage in chat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from splitbus.api.errors import BadRequest
from splitbus.api.protocol import LogitsOptions, check_logits_options, parse_chat, parse_completion
from splitbus.tokenization import ModelTokenizer
from tests.api.conftest import ApiProcess
from tests.api.responder import Responder, expected_text

ALL = {
    "presence_penalty": 1.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.1,
    "logit_bias": {"65": -100, "0066": 2.5},
    "min_tokens": 3,
    "min_p": 0.05,
    "stop_token_ids": [10, 13],
}
PARSED = LogitsOptions(1.5, -0.5, 1.1, {"65": -100.0, "66": 2.5}, 3, 0.05, [10, 13])


def test_every_field_is_taken_in_both_bodies() -> None:
    assert parse_completion({"model": "m", "prompt": "x", **ALL}).logits == PARSED
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **ALL})
    assert chat.logits == PARSED


def test_absent_or_null_fields_are_off() -> None:
    assert parse_completion({"model": "m", "prompt": "x"}).logits == LogitsOptions()
    nulls = parse_completion({"model": "m", "prompt": "x", **dict.fromkeys(ALL)})
    assert nulls.logits == LogitsOptions() and nulls.logits.repetition_penalty == 1.0


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("presence_penalty", 2.5, r"'presence_penalty' must be in \[-2.0, 2.0\]"),
        ("frequency_penalty", -2.1, r"'frequency_penalty' must be in \[-2.0, 2.0\]"),
        ("frequency_penalty", "1", "'frequency_penalty' must be a number"),
        ("repetition_penalty", 0, r"'repetition_penalty' must be in \(0.0, 2.0\]"),
        ("repetition_penalty", 3, r"'repetition_penalty' must be in \(0.0, 2.0\]"),
        ("min_p", 1.01, r"'min_p' must be in \[0.0, 1.0\]"),
        ("min_tokens", -1, "'min_tokens' must be >= 0"),
        ("min_tokens", 2.0, "'min_tokens' must be an integer"),
        ("logit_bias", [1, 2], "'logit_bias' must be an object"),
        ("logit_bias", {str(i): 1 for i in range(301)}, "at most 300 token ids, got 301"),
        ("logit_bias", {"-3": 1}, r"keys must be token ids in \[0, 2147483647\]"),
        ("logit_bias", {"2147483648": 1}, r"keys must be token ids in \[0, 2147483647\]"),
        ("logit_bias", {"9" * 5000: 1}, "keys must be token ids"),
        ("logit_bias", {"1": 101}, r"values must be numbers in \[-100.0, 100.0\], got 101"),
        ("logit_bias", {"1": True}, "values must be numbers"),
        ("stop_token_ids", 5, "must be a list of token ids"),
        ("stop_token_ids", [1, -1], r"must be a list of token ids in \[0, 2147483647\]"),
        ("stop_token_ids", [True], "must be a list of token ids"),
        ("stop_token_ids", list(range(1025)), "at most 1024 token ids"),
    ],
)
def test_bad_values_are_400s_naming_the_field(field: str, value: Any, says: str) -> None:
    with pytest.raises(BadRequest, match=says) as info:
        parse_completion({"model": "m", "prompt": "x", field: value})
    assert info.value.param == field and info.value.status == 400


def test_token_ids_are_checked_against_the_vocabulary_and_min_tokens_against_max_tokens() -> None:
    check_logits_options(LogitsOptions(logit_bias={"99": 1.0}, stop_token_ids=[99], min_tokens=16), 100, 16)
    for options, param, says in (
        (
            LogitsOptions(logit_bias={"100": 1.0}),
            "logit_bias",
            r"token id 100, outside the model's vocabulary \[0, 100\)",
        ),
        (LogitsOptions(stop_token_ids=[5, 100]), "stop_token_ids", "token id 100, outside"),
        (LogitsOptions(min_tokens=17), "min_tokens", r"'min_tokens' \(17\) must be <= max_tokens \(16\)"),
    ):
        with pytest.raises(BadRequest, match=says) as info:
            check_logits_options(options, 100, 16)
        assert info.value.param == param


def _client(api: ApiProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.v1, api_key="unused", max_retries=0, timeout=30)


def test_the_fields_reach_the_bus_from_the_openai_client(api: ApiProcess, responder: Responder) -> None:
    client = _client(api)
    native = dict(presence_penalty=1.5, frequency_penalty=-0.5, logit_bias={"65": -100, "66": 2.5})
    vllm = dict(repetition_penalty=1.1, min_tokens=3, min_p=0.05, stop_token_ids=[10, 13])
    reply = client.completions.create(model="tiny", prompt="x", max_tokens=5, **native, extra_body=vllm)  # type: ignore[arg-type]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=5,
        **native,
        extra_body=vllm,  # type: ignore[arg-type]
    )
    assert reply.choices[0].text == chat.choices[0].message.content == expected_text(5)[0]
    for rid in (reply.id, chat.id):
        (request,) = [r for r in responder.requests if r.request_id == rid]
        s = request.sampling
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (1.5, -0.5, 1.1)
        assert (s.logit_bias, s.min_tokens, s.min_p, s.stop_token_ids) == ({"65": -100.0, "66": 2.5}, 3, 0.05, [10, 13])


def test_ids_outside_the_vocabulary_and_min_tokens_past_max_tokens_are_400s(api: ApiProcess, tiny_model: Path) -> None:
    vocab = ModelTokenizer.load(tiny_model).vocab_size
    client = _client(api)
    for extra, param in (
        ({"logit_bias": {str(vocab): -100}}, "logit_bias"),
        ({"stop_token_ids": [vocab]}, "stop_token_ids"),
        ({"min_tokens": 17}, "min_tokens"),  # past the completions' default max_tokens, 16
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt="x", extra_body=extra)
        assert info.value.body["param"] == param  # type: ignore[index]
    assert client.completions.create(model="tiny", prompt="x", extra_body={"min_tokens": 16}).choices[0].text


def test_streamed_chat_with_usage(api: ApiProcess) -> None:
    chunks = list(
        _client(api).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text(7)[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].object == "chat.completion.chunk"
    assert all(c.usage is None for c in chunks[:-1])
