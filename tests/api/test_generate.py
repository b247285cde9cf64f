"""How a generation turns results into SSE events, on hand-made results (no server needed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from splitbus.api.errors import BadRequest
from splitbus.api.generate import EventStream, Generation, Queueing, request_priority, request_tenant
from splitbus.api.protocol import parse_completion
from splitbus.bus.messages import Failed, Finished, TokenDelta
from splitbus.bus.results import Subscription


def _merge(*arrived: object) -> list[object]:
    """The first result as the stream loop holds it, the rest already arrived."""
    state = SimpleNamespace(started=lambda request_id: None)
    generation = Generation(state, parse_completion({"model": "m", "prompt": "x", "stream": True}), [1], 8)  # type: ignore[arg-type]
    generation.sub = Subscription("r", "k")
    for result in arrived:
        generation.sub.accept(result)  # type: ignore[arg-type]
    merged = generation._merge_ready(generation.sub.get_nowait())  # type: ignore[arg-type]
    assert generation.sub.get_nowait() is None
    return merged  # type: ignore[return-value]


def test_tokens_that_arrived_together_go_out_as_one_event() -> None:
    assert _merge(TokenDelta(0, [10], "a"), TokenDelta(1, [11], "b"), TokenDelta(2, [12], "c")) == [
        TokenDelta(2, [10, 11, 12], "abc")
    ]


def test_the_final_entry_takes_the_text_before_it() -> None:
    (merged,) = _merge(TokenDelta(0, [10], "a"), TokenDelta(1, [11], "b"), Finished(2, "length", 1, 2, text="!"))
    assert (
        isinstance(merged, Finished)
        and merged.text == "ab!"
        and merged.token_ids == [10, 11]
        and merged.completion_tokens == 2
    )


def test_an_error_follows_the_text_that_came_before_it() -> None:
    assert _merge(TokenDelta(0, [10], "a"), Failed(1, "deadline", "too late", 504)) == [
        TokenDelta(0, [10], "a"),
        Failed(1, "deadline", "too late", 504),
    ]


def test_nothing_waiting_means_nothing_merged() -> None:
    assert _merge(TokenDelta(0, [10], "a")) == [TokenDelta(0, [10], "a")]


def test_the_special_token_options_travel_in_the_bus_message() -> None:
    reader = SimpleNamespace(reader_of=lambda request_id: "api-1.out.0")
    state = SimpleNamespace(config=SimpleNamespace(request_timeout_s=60, node_id="api-1"), reader=reader)
    body = {"model": "m", "prompt": "x", "skip_special_tokens": False, "spaces_between_special_tokens": False}
    sampling = Generation(state, parse_completion(body), [1], 8).message().sampling  # type: ignore[arg-type]
    assert sampling.skip_special_tokens is False and sampling.spaces_between_special_tokens is False
    default = Generation(state, parse_completion({"model": "m", "prompt": "x"}), [1], 8).message().sampling  # type: ignore[arg-type]
    assert default.skip_special_tokens is True and default.spaces_between_special_tokens is True
    message = Generation(state, parse_completion(body), [1], 8).message()  # type: ignore[arg-type]
    assert (message.api_node, message.reader) == ("api-1", "api-1.out.0")  # its workers write in the shard's slot


def test_a_value_the_bus_refuses_is_a_400_without_the_bus_text() -> None:
    """A parameter the API's checks let through but the bus's bounds refuse (here a seed set
    past them after parsing): 400 with a stable message naming the request, not the bus's text."""
    reader = SimpleNamespace(reader_of=lambda request_id: "api-1.out.0")
    state = SimpleNamespace(config=SimpleNamespace(request_timeout_s=60, node_id="api-1"), reader=reader)
    params = parse_completion({"model": "m", "prompt": "x"})
    params.seed = 2**70
    with pytest.raises(BadRequest) as raised:
        Generation(state, params, [1], 8, request_id="cmpl-1").message()  # type: ignore[arg-type]
    assert raised.value.message == "A parameter is outside the bounds this server accepts (request id cmpl-1)"


def test_the_priority_and_tenant_travel_in_the_bus_message() -> None:
    reader = SimpleNamespace(reader_of=lambda request_id: "api-1.out.0")
    state = SimpleNamespace(config=SimpleNamespace(request_timeout_s=60, node_id="api-1"), reader=reader)
    params = parse_completion({"model": "m", "prompt": "x", "n": 2})
    message = Generation(state, params, [1], 8, request_id="cmpl-1-1", queueing=Queueing(-3, "team-a")).message()  # type: ignore[arg-type]
    assert (message.priority, message.tenant, message.choices) == (-3, "team-a", 2)
    plain = Generation(state, parse_completion({"model": "m", "prompt": "x"}), [1], 8).message()  # type: ignore[arg-type]
    assert (plain.priority, plain.tenant) == (0, "")


def _http(**state: object) -> object:
    return SimpleNamespace(state=SimpleNamespace(**state))


def test_a_request_takes_its_tenants_priority_or_a_later_one_it_asks_for() -> None:
    body, default = {"model": "m", "prompt": "x"}, parse_completion({"model": "m", "prompt": "x"})
    limits = SimpleNamespace(priority=5)
    # Never earlier than its tenant's: a flooding client cannot jump the tenants ranked above it.
    assert request_priority(_http(tenant_limits=limits), parse_completion({**body, "priority": -1})) == 5  # type: ignore[arg-type]
    assert request_priority(_http(tenant_limits=limits), parse_completion({**body, "priority": 9})) == 9  # type: ignore[arg-type]
    assert request_priority(_http(), parse_completion({**body, "priority": -1})) == 0  # type: ignore[arg-type]
    assert request_priority(_http(tenant_limits=limits), default) == 5  # type: ignore[arg-type]
    assert request_priority(_http(), default) == 0  # type: ignore[arg-type]  # no tenant limits: keys alone
    assert request_priority(_http(tenant_limits=SimpleNamespace()), default) == 0  # type: ignore[arg-type]
    assert request_priority(_http(tenant_limits=SimpleNamespace(priority=2**40)), default) == 2**31 - 1  # type: ignore[arg-type]
    assert request_priority(_http(tenant_limits=SimpleNamespace(priority="5")), default) == 0  # type: ignore[arg-type]


def test_a_requests_tenant_is_its_keys_tenants_name_or_the_default_tenant() -> None:
    assert request_tenant(_http(tenant_name="team-a")) == "team-a"  # type: ignore[arg-type]
    assert request_tenant(_http()) == ""  # type: ignore[arg-type]
    assert request_tenant(_http(tenant_name=None)) == ""  # type: ignore[arg-type]


async def test_an_event_stream_sends_its_start_and_first_event_before_it_listens_or_streams_the_rest() -> None:
    """``EventStream``: the head and the first event from the request's own task, before
    Starlette's task group (its disconnect listener, the task that streams the rest) starts;
    then every other event in order and the end, as a ``StreamingResponse``."""
    log: list[Any] = []

    async def body() -> AsyncIterator[bytes]:
        for chunk in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            log.append(("yield", chunk))
            yield chunk

    async def send(message: dict[str, Any]) -> None:
        log.append((message["type"], message.get("body")))

    async def receive() -> dict[str, Any]:
        log.append(("receive", None))
        await asyncio.Event().wait()  # the client never leaves: the listener is cancelled at the end
        raise AssertionError("unreachable")

    await EventStream(body(), media_type="text/event-stream")({"type": "http", "asgi": {}}, receive, send)
    sent = [entry for entry in log if entry[0] == "http.response.body"]
    assert log[:3] == [("http.response.start", None), ("yield", b"data: 1\n\n"), ("http.response.body", b"data: 1\n\n")]
    assert log.index(("receive", None)) > 2
    assert [b for _, b in sent] == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n", b""]


async def test_an_event_stream_with_no_event_sends_its_start_and_its_end() -> None:
    async def body() -> AsyncIterator[bytes]:
        return
        yield b""

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    await EventStream(body())({"type": "http", "asgi": {}}, receive, send)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["more_body"] is False
