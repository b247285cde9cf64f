"""A worker's spans (splitbus/worker/spans.py) on a real worker's steps and outbox: a prefill that
raises ends its span failed, and a request that leaves the worker ends the spans it still has
open, so that every span started is sent. tests/test_tracing.py follows the spans of a request
that goes through."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus import tracing
from splitbus.bus.core.config import BusConfig
from splitbus.worker.sequence import SeqSpans, Sequence
from splitbus.worker.worker import Worker
from tests import traced
from tests.worker.test_stepper import mixed_worker, queue


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    with traced.in_memory() as exporter:
        yield exporter


def _traced_queue(worker: Worker, request_id: str) -> Sequence:
    """A task taken from a traced request: waiting in ``worker.prefill_queue`` (``spans.taken``)."""
    seq = queue(worker, request_id)
    seq.trace = SeqSpans(traced.CLIENT, tracing.start("worker.prefill_queue", traced.CLIENT))
    return seq


def _ended(exporter: InMemorySpanExporter, name: str) -> list[tuple[StatusCode, str | None]]:
    return [(s.status.status_code, s.status.description) for s in exporter.get_finished_spans() if s.name == name]


async def test_a_prefill_that_raises_ends_its_span_failed_and_waits_in_the_queue_again(
    bus_config: BusConfig, tiny_model: Path, exported: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = mixed_worker(bus_config, tiny_model)
    _traced_queue(worker, "r-1")

    async def redis_refuses() -> None:
        raise RedisConnectionError("Redis restarting")

    monkeypatch.setattr(worker.steps, "settle", redis_refuses)
    try:
        with pytest.raises(RedisConnectionError):
            await worker.steps.prefill_queued()
        monkeypatch.undo()
        await worker.steps.prefill_queued()
        failed, done = (StatusCode.ERROR, "ConnectionError"), (StatusCode.UNSET, None)
        assert _ended(exported, "worker.prefill") == [failed, done]
        assert _ended(exported, "worker.prefill_queue") == [done, done]  # queued again after the failure
    finally:
        await worker.loops.close()
        await worker.redis.aclose()


async def test_a_request_that_leaves_ends_its_open_spans(
    bus_config: BusConfig, tiny_model: Path, exported: InMemorySpanExporter
) -> None:
    worker = mixed_worker(bus_config, tiny_model)
    running = _traced_queue(worker, "r-1")
    try:
        await worker.stepper.step()  # prefilled, one decode step: worker.decode open
        queued = _traced_queue(worker, "r-2")
        assert "worker.decode" not in traced.named(exported)
        worker.apply([*worker.core.cancel("r-1"), *worker.core.cancel("r-2")])
        spans = traced.named(exported)
        decode = spans["worker.decode"].attributes or {}
        assert (decode["splitbus.outcome"], decode["splitbus.output_tokens"]) == ("ended", len(running.output_ids))
        assert (spans["worker.prefill_queue"].attributes or {})["splitbus.outcome"] == "ended"
        assert running.trace == queued.trace == SeqSpans(traced.CLIENT)  # nothing left open
    finally:
        await worker.loops.close()
        await worker.redis.aclose()
