"""Early refusal against a live API (real redis, the scripted responder answering): a forged
prefill worker of the model reports a deep queue. While its prefill counter stands still the API
has no measured rate and admits (a cold start never refuses); once the counter grows, the
predicted wait passes the 5 s timeout and requests are refused with 503 and ``Retry-After``
before anything is published, and counted as refusals of their tenant; once its queue is empty
again, requests are admitted. By priority: while the API holds requests of priority 1 not
started, one of priority 0 waits behind none of the queue and is admitted where one of priority 1
is refused; once those have ended, priority 0 is refused again (the API's count of them is
back to none)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from splitbus.api.admission import MAX_RETRY_AFTER_S
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.records import WorkerLoad
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.redis_server import EmbeddedRedis
from tests.api.conftest import ApiProcess, running_api
from tests.api.responder import Responder

DEEP = 1_000_000
"""The forged worker's waiting requests: at any measured rate of a few per second, a wait of days."""
LEASE_MS = 120_000
T = TypeVar("T")


class Forged:
    """A prefill worker of ``tiny`` that exists only as its registry record."""

    def __init__(self, config: BusConfig) -> None:
        self.config = config
        self.waiting = DEEP
        self.done = 0

    def publish(self) -> None:
        asyncio.run(self._publish())

    async def _publish(self) -> None:
        redis = connect(self.config)
        try:
            load = WorkerLoad(waiting=self.waiting, prefills_done=self.done)
            record = WorkerRecord(worker_id="forged-prefill", role="prefill", model="tiny", load=load)
            await Registry(redis, self.config).register(record, LEASE_MS)
        finally:
            await redis.aclose()


@pytest.fixture(scope="module")
def forged(redis_server: EmbeddedRedis, prefix: str) -> Forged:
    worker = Forged(BusConfig(redis_url=redis_server.url, prefix=prefix))
    worker.publish()
    return worker


@pytest.fixture(scope="module")
def api(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder, forged: Forged
) -> Iterator[ApiProcess]:
    """Started after the forged worker registered: the API's first registry snapshot holds its queue."""
    yield from running_api(redis_server.url, prefix, [tiny_model], "--request-timeout", "5")


def _complete(api: ApiProcess) -> httpx.Response:
    return httpx.post(api.v1 + "/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=10)


def _body(priority: int, prompt: str = "hi") -> dict[str, object]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "priority": priority}


def _until(api: ApiProcess, forged: Forged, status: int) -> httpx.Response:
    """Requests until one answers ``status`` (at most 40 s), the forged counter growing meanwhile."""
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        forged.done += 5
        forged.publish()
        response = _complete(api)
        if response.status_code == status:
            return response
        time.sleep(0.3)
    raise AssertionError(f"no {status} within 40 s")


def _overloaded(api: ApiProcess) -> float:
    """The early refusals of the default tenant on ``api``'s /metrics."""
    sample = 'splitbus_api_tenant_requests_total{outcome="overloaded",tenant="default"} '
    lines = httpx.get(api.url + "/metrics", timeout=5).text.splitlines()
    return sum(float(line[len(sample) :]) for line in lines if line.startswith(sample))


def test_a_cold_start_never_refuses(api: ApiProcess, forged: Forged) -> None:
    for _ in range(3):  # a deep queue, but no prefill measured yet
        assert _complete(api).status_code == 200


def test_a_request_that_cannot_start_in_time_is_refused_early(api: ApiProcess, forged: Forged) -> None:
    refused = _until(api, forged, 503)
    assert refused.headers["retry-after"] == str(MAX_RETRY_AFTER_S)  # days of queue: the longest advice
    error = refused.json()["error"]
    assert error["code"] == "overloaded"
    assert "past the 5s timeout" in error["message"]
    assert _overloaded(api) >= 1  # counted as its tenant's refusal (no keys: the tenant default)
    forged.waiting = 0  # the queue drained: admitted again
    assert _until(api, forged, 200).json()["choices"][0]["text"]


def test_under_overload_an_earlier_priority_than_the_apis_waiting_requests_is_admitted(
    api: ApiProcess, forged: Forged, responder: Responder
) -> None:
    forged.waiting = DEEP
    _until(api, forged, 503)  # a rate measured, the queue deep: refused
    forged.waiting = 0
    _until(api, forged, 200)  # drained: the silent ones below are admitted
    asyncio.run(_priorities(api, forged, responder))


async def _priorities(api: ApiProcess, forged: Forged, responder: Responder) -> None:
    async with httpx.AsyncClient(base_url=api.v1, timeout=30) as client:
        served = len(responder.served)
        waiting = [asyncio.ensure_future(client.post("/completions", json=_body(1, "[silent]"))) for _ in range(3)]
        await _eventually(lambda: _true(len(responder.served) >= served + 3), "the silent requests published")
        silent = set(responder.served[served:])
        forged.waiting = DEEP
        await forged._publish()
        refused = await _eventually(lambda: _status(client, 1, 503), "a priority 1 refusal")
        assert refused.json()["error"]["code"] == "overloaded"
        admitted = await client.post("/completions", json=_body(0))  # behind none of its priority or earlier
        assert admitted.status_code == 200 and admitted.json()["choices"][0]["text"]
        for request in waiting:  # their clients leave: cancelled, no longer waiting at the API
            request.cancel()
        await _eventually(lambda: _status(client, 0, 503), "a priority 0 refusal once none of priority 1 waits")
        await _eventually(lambda: _true(silent <= set(responder.cancelled)), "the silent requests cancelled")


async def _true(value: bool) -> bool:
    return value


async def _status(client: httpx.AsyncClient, priority: int, status: int) -> httpx.Response | None:
    response = await client.post("/completions", json=_body(priority))
    return response if response.status_code == status else None


async def _eventually(attempt: Callable[[], Awaitable[T | None]], what: str) -> T:
    """``attempt`` every 0.1 s until it gives something (at most 5 s: the silent requests' deadline)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        found = await attempt()
        if found:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {what} within 5 s")
