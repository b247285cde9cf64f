"""The scheduler's spans (splitbus/scheduler/spans.py) on a real scheduler: a dispatch or a move
whose write raises (Redis refused) still ends its span, failed by the error's type, so that it is
sent; tests/test_tracing.py follows the spans of a dispatch that ends."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.streams import Delivery
from splitbus.bus.messages import GenerateRequest, Task
from splitbus.bus.results import Sent
from splitbus.scheduler.config import SchedulerConfig
from splitbus.scheduler.scheduler import Scheduler, Waiting
from tests import traced
from tests.placement.snapshot import request


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    with traced.in_memory() as exporter:
        yield exporter


@pytest.fixture
async def scheduler(bus_config: BusConfig) -> AsyncIterator[Scheduler]:
    scheduler = Scheduler(SchedulerConfig(bus_config))
    yield scheduler
    await scheduler.redis.aclose()


async def _refused(*args: object) -> None:
    raise RedisConnectionError("Redis restarting")


def _traced_request() -> GenerateRequest:
    return dataclasses.replace(request(), traceparent=traced.CLIENT)


def _failed_by(exporter: InMemorySpanExporter, name: str) -> tuple[StatusCode, str | None]:
    span = traced.named(exporter)[name]
    return span.status.status_code, span.status.description


async def test_a_dispatch_that_raises_ends_its_place_span_failed(
    scheduler: Scheduler, exported: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler.dispatcher, "dispatch", _refused)
    traced_request = _traced_request()
    delivery = Delivery("requests", "1-0", traced_request, time.time_ns() // 1000)
    with pytest.raises(RedisConnectionError):
        await scheduler.dispatch(Waiting(delivery, time.monotonic()), traced_request, [])
    assert _failed_by(exported, "scheduler.place") == (StatusCode.ERROR, "ConnectionError")
    assert "scheduler.wait" not in traced.named(exported)  # nothing was written: no wait ended


async def test_a_move_that_raises_ends_its_move_span_failed(
    scheduler: Scheduler, exported: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler.dispatcher, "redispatch", _refused)
    task = Task("decode", _traced_request(), "p0", traceparent=traced.CLIENT)
    with pytest.raises(RedisConnectionError):
        await scheduler.reaper.redispatch("d0", Delivery("tasks", "1-0", task), task, [], Sent())
    assert _failed_by(exported, "scheduler.move") == (StatusCode.ERROR, "ConnectionError")
