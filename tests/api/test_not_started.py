"""The requests an API node published that have not started yet (``ApiState.waiting``, early
refusal's estimate of the queue's priorities: docs/tenants.md, "Early refusal"): each is counted
at its priority once published and no longer once its first result came or it ended without one,
on every path a request can take. A real ``ApiState`` with no Redis: its writes and the limiter
are stand-ins, its result reader's subscriptions are fed by hand."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.responses import StreamingResponse

from splitbus.api import choices
from splitbus.api.config import ApiConfig
from splitbus.api.errors import ApiError, GatewayTimeout, ServiceUnavailable, TooManyRequests
from splitbus.api.generate import ClientDisconnected, EventStream, Generation, Queueing, answer
from splitbus.api.protocol import parse_completion
from splitbus.api.state import ApiState
from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import Failed, Finished, GenerateRequest, TokenDelta
from splitbus.bus.records import Reserved, WorkerLoad
from splitbus.bus.registry import WorkerInfo, WorkerRecord
from splitbus.tokenization import ModelTokenizer

UNUSED_REDIS = "redis://127.0.0.1:1/0"
"""Nothing here reaches Redis: the state's client connects only when used."""


class Client:
    """The HTTP request as ``answer`` reads it: no tenant, and a disconnect once ``leave`` is called."""

    def __init__(self) -> None:
        self.state = SimpleNamespace()
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, str]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> ApiState:
    """A state whose view holds a live prefill worker of ``m`` (no rate measured: nothing is
    refused early), whose writes to the request stream succeed without Redis, and whose
    cancellations are recorded (``state.cancelled``)."""
    api = ApiState(ApiConfig(bus=BusConfig(redis_url=UNUSED_REDIS), models=(), request_timeout_s=30), {})
    record = WorkerRecord(worker_id="p", role="prefill", model="m", load=WorkerLoad())
    api.workers.workers = [WorkerInfo(record, 0, 1000, Reserved())]
    api.workers.redis_ok = True
    cancelled: list[tuple[str, str]] = []

    async def submit(request: GenerateRequest) -> None:
        api.submissions.hold(request)

    async def submit_together(requests: list[GenerateRequest]) -> None:
        for request in requests:
            api.submissions.hold(request)

    monkeypatch.setattr(api.submissions, "submit", submit)
    monkeypatch.setattr(api.submissions, "submit_together", submit_together)
    monkeypatch.setattr(api, "cancel_later", lambda request_id, reason: cancelled.append((request_id, reason)))
    api.cancelled = cancelled  # type: ignore[attr-defined]
    return api


@pytest.fixture
def streaming(state: ApiState, tiny_model: Path) -> ApiState:
    """``state`` with a tokenizer for ``m``: its streams render their events."""
    state.tokenizers["m"] = ModelTokenizer.load(tiny_model)
    return state


def _generation(state: ApiState, priority: int, n: int = 1, index: int = 0) -> Generation:
    params = parse_completion({"model": "m", "prompt": "x", "stream": True, "n": n})
    request_id = f"cmpl-{priority}-{index}"
    return Generation(state, params, [1], 8, request_id=request_id, index=index, queueing=Queueing(priority, ""))


async def _published(state: ApiState, work: Awaitable[Any], *request_ids: str) -> asyncio.Future[Any]:
    """``work`` running until every one of ``request_ids`` is counted as waiting (it awaits its first result)."""
    task = asyncio.ensure_future(work)
    for _ in range(100):
        if all(r in state.waiting.priorities for r in request_ids):
            return task
        await asyncio.sleep(0)
    task.cancel()
    raise AssertionError(f"{request_ids} never counted as waiting: {state.waiting.priorities}")


async def test_a_request_waits_at_its_priority_until_its_first_token(state: ApiState) -> None:
    generation = _generation(state, -1)
    task = await _published(state, answer(Client(), generation), "cmpl--1-0")  # type: ignore[arg-type]
    assert state.waiting.mix == {-1: 1}
    assert generation.sub is not None
    generation.sub.accept(TokenDelta(0, [5], "a"))
    assert isinstance(await task, StreamingResponse)
    assert len(state.waiting) == 0 and state.inflight == 1  # started: still streaming, no longer waiting
    generation.close(None)
    assert len(state.waiting) == 0 and state.inflight == 0


async def test_a_first_result_that_is_an_error_ends_the_wait(state: ApiState) -> None:
    generation = _generation(state, 0)
    task = await _published(state, answer(Client(), generation), "cmpl-0-0")  # type: ignore[arg-type]
    assert generation.sub is not None
    generation.sub.accept(Failed(0, "handler_failed", "boom", 500))
    with pytest.raises(ApiError):
        await task
    assert len(state.waiting) == 0 and state.inflight == 0 and state.cancelled == []  # type: ignore[attr-defined]


async def test_a_client_that_leaves_before_its_first_result_waits_no_longer(state: ApiState) -> None:
    client = Client()
    task = await _published(state, answer(client, _generation(state, 2)), "cmpl-2-0")  # type: ignore[arg-type]
    client.gone.set()
    with pytest.raises(ClientDisconnected):
        await task
    assert len(state.waiting) == 0 and state.inflight == 0
    assert state.cancelled == [("cmpl-2-0", "client_disconnected")]  # type: ignore[attr-defined]


async def test_a_client_leaving_in_the_turn_its_first_result_comes_is_left_to_the_stream(streaming: ApiState) -> None:
    """The watcher ends (the client left) in the loop turn the first result comes: its callback
    runs after ``first_result`` returned and must not mark the subscription left, or the stream's
    next wait raises out of the response (a 500); the stream's own listener sees the disconnect."""
    client, generation = Client(), _generation(streaming, 0)
    task = await _published(streaming, answer(client, generation), "cmpl-0-0")  # type: ignore[arg-type]
    assert generation.sub is not None
    client.gone.set()
    generation.sub.accept(TokenDelta(0, [5], "a"))  # the same turn: both the watcher and the request wake
    response = await task
    await asyncio.sleep(0)  # (the watcher's done-callback has run)
    assert isinstance(response, EventStream) and not generation.sub.left
    generation.sub.accept(Finished(1, "stop", 1, 1))
    chunks = [chunk async for chunk in response.body_iterator]
    assert chunks[-1] == b"data: [DONE]\n\n" and b'"text":"a"' in chunks[0]
    assert streaming.cancelled == []  # type: ignore[attr-defined]


async def test_a_stream_whose_client_left_while_it_waited_ends_quietly(streaming: ApiState) -> None:
    """A subscription told its client left (``leave``) ends the events without an error: the
    request is cancelled as a disconnect, nothing raised out of the response."""
    generation = _generation(streaming, 0)
    task = await _published(streaming, answer(Client(), generation), "cmpl-0-0")  # type: ignore[arg-type]
    assert generation.sub is not None
    generation.sub.accept(TokenDelta(0, [5], "a"))
    response = await task
    generation.sub.leave()
    chunks = [chunk async for chunk in response.body_iterator]
    assert len(chunks) == 2 and b'"text":"a"' in chunks[0] and chunks[1] == b"data: [DONE]\n\n"
    assert streaming.cancelled == [("cmpl-0-0", "client_disconnected")]  # type: ignore[attr-defined]


async def test_a_first_token_that_shows_nothing_leaves_the_wait_to_the_disconnect_listener(streaming: ApiState) -> None:
    """A first token with no text (part of a character) and no logprobs renders no event: the
    stream still yields (b"") on its first pass, so the response starts Starlette's disconnect
    listener before it waits for the next result, and a client that leaves is let go."""
    client, generation = Client(), _generation(streaming, 0)
    task = await _published(streaming, answer(client, generation), "cmpl-0-0")  # type: ignore[arg-type]
    assert generation.sub is not None
    generation.sub.accept(TokenDelta(0, [5], ""))
    response = await task
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    client.gone.set()
    async with asyncio.timeout(30):  # (without the first yield, the response waits for a token that never comes)
        await response({"type": "http", "asgi": {}}, client.receive, send)
    assert [m["type"] for m in sent] == ["http.response.start"]  # the empty chunk is not sent
    await response.body_iterator.aclose()  # type: ignore[attr-defined]
    assert streaming.cancelled == [("cmpl-0-0", "client_disconnected")]  # type: ignore[attr-defined]


async def test_a_request_cancelled_before_its_first_result_waits_no_longer(state: ApiState) -> None:
    task = await _published(state, answer(Client(), _generation(state, 0)), "cmpl-0-0")  # type: ignore[arg-type]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(state.waiting) == 0 and state.inflight == 0


async def test_a_request_past_its_deadline_waits_no_longer(state: ApiState) -> None:
    generation = _generation(state, 0)
    task = await _published(state, answer(Client(), generation), "cmpl-0-0")  # type: ignore[arg-type]
    assert generation.sub is not None
    generation.sub._expire()  # its deadline (and the grace) passed with no result
    with pytest.raises(GatewayTimeout):
        await task
    assert len(state.waiting) == 0 and state.inflight == 0
    assert state.cancelled == [("cmpl-0-0", "deadline")]  # type: ignore[attr-defined]


async def test_a_request_the_limiter_refuses_is_never_counted(state: ApiState, monkeypatch: pytest.MonkeyPatch) -> None:
    async def refuse(*args: object) -> None:
        raise TooManyRequests("over the tenant's requests per second")

    monkeypatch.setattr(state.limits, "admit", refuse)
    with pytest.raises(TooManyRequests):
        await answer(Client(), _generation(state, 0))  # type: ignore[arg-type]
    assert len(state.waiting) == 0 and state.inflight == 0


async def test_a_request_redis_could_not_take_is_never_counted(
    state: ApiState, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unreachable(request: GenerateRequest) -> None:
        raise ConnectionError("Redis went away")

    monkeypatch.setattr(state.submissions, "submit", unreachable)
    with pytest.raises(ServiceUnavailable, match="Redis is unreachable"):
        await answer(Client(), _generation(state, 0))  # type: ignore[arg-type]
    assert len(state.waiting) == 0 and state.inflight == 0


async def test_each_choice_waits_as_a_request_until_one_fails_and_ends_them_all(state: ApiState) -> None:
    many = [_generation(state, -1, n=2, index=i) for i in range(2)]
    work = choices.generate_many(Client(), many)  # type: ignore[arg-type]
    task = await _published(state, work, "cmpl--1-0", "cmpl--1-1")
    assert state.waiting.mix == {-1: 2}  # a choice is a request of the queue ahead
    assert many[0].sub is not None and many[1].sub is not None
    many[0].sub.accept(TokenDelta(0, [5], "a"))
    many[1].sub.accept(Failed(0, "handler_failed", "boom", 500))
    with pytest.raises(ApiError):
        await task
    assert len(state.waiting) == 0 and state.inflight == 0
