"""Early refusal against a live API (real redis, the scripted responder answering): a forged
prefill worker of the model reports a deep queue. While its prefill counter stands still the API
has no measured rate and admits (a cold start never refuses); once the counter grows, the
predicted wait passes the 5 s timeout and requests are refused with 503 and ``Retry-After``
before anything is published, and counted as refusals of their tenant; once its queue is empty
again, requests are admitted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

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
