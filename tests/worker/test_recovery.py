"""A worker after a new Redis run, against a real Redis: the run kept a prefix of what was
written, so a held task's dispatch, its entry or its KV reservation may be gone. The worker writes
its dispatch again (or drops the task if the request was dispatched again), its reservation, and
its peer's task; a peer that holds the request acks the copy. A restarted server's new run id is
what starts it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import TRANSIENT_ERRORS
from splitbus.bus.core.keys import WORKER_GROUP
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.bus.reservations import Reservations
from splitbus.redis_server import EmbeddedRedis
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.table import Status
from splitbus.worker.worker import Worker
from tests.worker.replies import add, decoded


def _make(bus: BusConfig, tiny_model: Path, role: str, worker_id: str) -> Worker:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(bus=bus, role=role, model_dir=tiny_model, model_name="tiny", worker_id=worker_id)
    return Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 64, 16))


async def _started(worker: Worker) -> Worker:
    await worker.join_bus()
    assert await worker.tasks.read(10, block_ms=0) == []
    return worker


async def _close(worker: Worker) -> None:
    await worker.loops.close()
    await worker.redis.aclose()


@pytest.fixture
async def prefill(bus_config: BusConfig, tiny_model: Path) -> AsyncIterator[Worker]:
    worker = await _started(_make(bus_config, tiny_model, "prefill", "p1"))
    yield worker
    await _close(worker)


@pytest.fixture
async def decode(bus_config: BusConfig, tiny_model: Path) -> AsyncIterator[Worker]:
    worker = await _started(_make(bus_config, tiny_model, "decode", "d1"))
    yield worker
    await _close(worker)


def _task(phase: str, peer: str, request_id: str = "r1", handoff: str = "h1") -> Task:
    deadline_ms = int(time.time() * 1000) + 60_000
    request = GenerateRequest(request_id, "tiny", [97, 98], SamplingParams(max_tokens=4), "api", deadline_ms)
    return Task(phase, request, peer, handoff=handoff)


async def _take(worker: Worker, task: Task) -> str:
    """Send the worker a task (as a dispatch would, without its ``sb:current``) and take it."""
    entry_id = await add(worker.redis, worker.keys.tasks(worker.id), task)
    await worker.feed.feed_tasks()
    return entry_id


async def _lose(worker: Worker, entry_id: str) -> None:
    """What a run that kept a prefix leaves of a task just dispatched: neither the entry nor its
    delivery to the worker (XDEL alone leaves it pending)."""
    await worker.redis.xack(worker.keys.tasks(worker.id), WORKER_GROUP, entry_id)
    await worker.redis.xdel(worker.keys.tasks(worker.id), entry_id)


async def test_a_lost_dispatch_is_written_again_with_the_peers_task(prefill: Worker) -> None:
    entry_id = await _take(prefill, _task("prefill", "d1"))
    assert [s.request_id for s in prefill.requests.of(Status.QUEUED)] == ["r1"]
    await _lose(prefill, entry_id)  # lost with its dispatch
    done = await prefill.recovery.recover()
    assert (done.dispatches, done.dropped, done.peer_tasks) == (1, 0, 1)
    assert await prefill.redis.get(prefill.keys.current("r1")) == b"h1"
    [copy] = await decoded(prefill.redis, prefill.keys.tasks("d1"))
    assert isinstance(copy, Task)
    assert (copy.phase, copy.peer, copy.handoff, copy.reserved) == ("decode", "p1", "h1", [0, 0, 0])
    assert copy.request.request_id == "r1"
    assert [s.request_id for s in prefill.requests.of(Status.QUEUED)] == ["r1"]  # still its to prefill
    again = await prefill.recovery.recover()  # owed again (a Redis error): the same writes
    assert again.peer_tasks == 1 and again.dispatches == 1


async def test_a_task_whose_request_was_dispatched_again_is_dropped(prefill: Worker) -> None:
    await _take(prefill, _task("prefill", "d1"))
    await prefill.redis.set(prefill.keys.current("r1"), "h-new")
    done = await prefill.recovery.recover()
    assert (done.dispatches, done.dropped, done.peer_tasks) == (0, 1, 0)
    assert prefill.requests.of() == []
    assert await prefill.redis.get(prefill.keys.current("r1")) == b"h-new"


async def test_a_decode_task_writes_its_reservation_again_and_acks_its_copy(decode: Worker) -> None:
    entry_id = await _take(decode, _task("decode", "p1"))
    [seq] = decode.requests.of(Status.AWAITING_KV)
    reservations = Reservations(decode.redis, decode.keys)
    before = await reservations.read("r1")
    assert before is not None
    await decode.redis.delete(decode.keys.kv("r1"))  # the run lost it
    done = await decode.recovery.recover()
    assert done.reservations == 1 and done.peer_tasks == 0  # its entry is there: no peer task
    assert await reservations.read("r1") == before  # the same secret: P's frame is still taken
    copy_id = await _take(decode, _task("decode", "p1"))  # P sent D's task again
    assert decode.requests.of(Status.AWAITING_KV) == [seq] and seq.entry_id == entry_id
    assert copy_id in decode.outbox.done_entries  # acked at the next publish, not taken


async def test_a_new_server_run_starts_the_recovery(bus_config: BusConfig, tiny_model: Path, tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False)
    server.start()
    worker = _make(BusConfig(redis_url=server.url, prefix=bus_config.prefix, block_ms=200), tiny_model, "prefill", "p9")
    try:
        await _started(worker)
        await _take(worker, _task("prefill", "d9"))
        await worker.lease.heartbeat()
        assert not worker.recovery.new_run.owed  # the same run: nothing to do
        server.stop()
        server.start()  # the same port, no AOF: everything was lost
        await _beat_until_it_takes(worker)
        assert not worker.recovery.new_run.owed
        assert await worker.redis.get(worker.keys.current("r1")) == b"h1"
        [copy] = await decoded(worker.redis, worker.keys.tasks("d9"))
        assert isinstance(copy, Task) and copy.phase == "decode"
    finally:
        await _close(worker)
        server.stop()


async def _beat_until_it_takes(worker: Worker) -> None:
    """Heartbeats until one goes through (the first ones meet the restart)."""
    for _ in range(100):
        try:
            await worker.lease.heartbeat()
            return
        except TRANSIENT_ERRORS:
            await asyncio.sleep(0.1)
    raise AssertionError("no heartbeat went through after the restart")


@pytest.mark.parametrize("new_run", [True, False])
async def test_a_rejoin_after_a_new_run_keeps_the_tasks_whose_entries_it_lost(prefill: Worker, new_run: bool) -> None:
    """A lease that lapsed in the outage: what is no longer pending to the worker moved away,
    unless its entry is gone from the stream after a new run (lost: no reaper can take it)."""
    entry_id = await _take(prefill, _task("prefill", "d1"))
    await _lose(prefill, entry_id)
    prefill.feed.new_run.owed = new_run
    await prefill.feed.drop_moved()
    assert [s.request_id for s in prefill.requests.of()] == (["r1"] if new_run else [])
