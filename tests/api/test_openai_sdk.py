"""The official `openai` SDK against a live API process: it must work unchanged."""

from __future__ import annotations

import time

import openai
import pytest

from splitbus.bus.blocks import chain_hex
from tests.api.conftest import ApiProcess
from tests.api.responder import Responder, expected_text


def _client(api: ApiProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.v1, api_key="unused", max_retries=0, timeout=30)


def test_completion(api: ApiProcess) -> None:
    reply = _client(api).completions.create(model="tiny", prompt="Say something", max_tokens=12)
    text, reason = expected_text(12)
    assert reply.choices[0].text == text
    assert reply.choices[0].finish_reason == reason == "length"
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len("Say something"), 12)
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == len("Say something") // 2


def test_completion_default_max_tokens_is_16(api: ApiProcess) -> None:
    reply = _client(api).completions.create(model="tiny", prompt="hi")
    assert reply.choices[0].text == expected_text(16)[0]


def test_completion_from_token_ids(api: ApiProcess) -> None:
    reply = _client(api).completions.create(model="tiny", prompt=[72, 73, 74], max_tokens=5)
    assert reply.choices[0].text == expected_text(5)[0]
    assert reply.usage is not None and reply.usage.prompt_tokens == 3


def test_a_request_carries_its_prompts_hash_chain_for_routing(api: ApiProcess, responder: Responder) -> None:
    prompt = list(range(40, 140))  # 99 tokens hashed: 6 full blocks of 16
    reply = _client(api).completions.create(model="tiny", prompt=prompt, max_tokens=2)
    (request,) = [r for r in responder.requests if r.request_id == reply.id]
    assert request.prefix_block_size == 16 and request.prefix_hashes == chain_hex(prompt[:-1], 16)
    assert len(request.prefix_hashes) == 6 * 32 and request.cache_salt == ""  # no keys, no cache_salt: unsalted


def test_a_cache_salt_salts_the_requests_chain(api: ApiProcess, responder: Responder) -> None:
    prompt = list(range(40, 140))
    salts = []
    for salt in ("team-1", "team-2", "team-1"):
        reply = _client(api).completions.create(
            model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt}
        )
        (request,) = [r for r in responder.requests if r.request_id == reply.id]
        assert request.prefix_hashes == chain_hex(prompt[:-1], 16, salt=request.cache_salt)
        salts.append(request.cache_salt)
    assert salts[0] == salts[2] != salts[1] and "" not in salts and not any("team" in s for s in salts)


def test_a_requests_priority_reaches_the_bus_and_a_bad_one_is_a_400(api: ApiProcess, responder: Responder) -> None:
    """vLLM's ``priority`` on both endpoints; without it the tenant's default, 0 (no keys: "default")."""
    client = _client(api)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"priority": 7}
    )
    plain = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    sent = {r.request_id: (r.priority, r.tenant) for r in responder.requests}
    assert (sent[chat.id], sent[plain.id]) == ((7, "default"), (0, "default"))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"priority": 2**31})
    assert info.value.status_code == 400 and "'priority' must be <= 2147483647" in info.value.message


def test_a_requests_timeout_sets_its_deadline_on_the_bus_held_to_the_servers(
    api: ApiProcess, responder: Responder
) -> None:
    """The module's API runs with --request-timeout 5: a request's ``timeout`` of 1.5 s shortens its
    deadline, one of 10^6 s is held to 5 s, none is 5 s; a bad one is a 400 naming the field."""
    client = _client(api)
    for asked, given_s in ((1.5, 1.5), (10**6, 5), (None, 5)):
        before = time.time()
        reply = client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, extra_body={} if asked is None else {"timeout": asked}
        )
        after = time.time()
        (request,) = [r for r in responder.requests if r.request_id == reply.id]
        assert int((before + given_s) * 1000) <= request.deadline_ms <= int((after + given_s) * 1000)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"timeout": -1}
        )
    assert info.value.status_code == 400 and "'timeout' must be a number of seconds > 0" in info.value.message


def test_streamed_completion_with_usage(api: ApiProcess) -> None:
    stream = _client(api).completions.create(
        model="tiny", prompt="Stream it", max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(20)[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == len("Stream it") // 2
    assert len({c.id for c in chunks}) == 1


def test_chat_completion(api: ApiProcess) -> None:
    reply = _client(api).chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=9,
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected_text(9)[0]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    # The ChatML template of the tiny model wraps both messages.
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    specials = rendered.count("<|im_start|>") + rendered.count("<|im_end|>")  # one token each
    plain_chars = len(rendered.replace("<|im_start|>", "").replace("<|im_end|>", ""))  # one token per byte
    assert reply.usage is not None and reply.usage.prompt_tokens == plain_chars + specials == 43


def test_streamed_chat_starts_with_the_role(api: ApiProcess) -> None:
    stream = _client(api).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=15, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected_text(15)[0]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_string_ends_with_stop(api: ApiProcess) -> None:
    reply = _client(api).completions.create(model="tiny", prompt="x", max_tokens=30, stop=["fox"])
    assert reply.choices[0].text == "The quick brown "
    assert reply.choices[0].finish_reason == "stop"


def test_unknown_fields_are_ignored(api: ApiProcess) -> None:
    reply = _client(api).completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"no_such_option": 1})
    assert reply.choices[0].text == expected_text(3)[0]


def test_models_lists_what_live_workers_serve(api: ApiProcess) -> None:
    models = _client(api).models.list()
    assert [m.id for m in models.data] == ["tiny"]


@pytest.mark.parametrize("stream", [False, True])
async def test_async_client(api: ApiProcess, stream: bool) -> None:
    client = openai.AsyncOpenAI(base_url=api.v1, api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "async"}]
    if stream:
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=11, stream=True
            )
        ]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=11)
        text = reply.choices[0].message.content or ""
    assert text == expected_text(11)[0]
    await client.close()
