"""How a worker takes its tasks from its stream, against a real Redis: nothing delivered to it is
left unseen, whatever happened to the read that brought it."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeout
from redis.typing import EncodableT, FieldT

from splitbus.bus.core import codec
from splitbus.bus.core.aio import cancel_and_wait
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import forever
from splitbus.bus.core.keys import WORKER_GROUP
from splitbus.bus.messages import Failed, GenerateRequest, SamplingParams, Task
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.table import Status
from splitbus.worker.worker import Worker
from tests.worker.replies import add, decoded, fields


@pytest.fixture
async def worker(bus_config: BusConfig, tiny_model: Path):  # type: ignore[no-untyped-def]
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(bus=bus_config, role="prefill", model_dir=tiny_model, model_name="tiny", worker_id="p1")
    worker = Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 64, 16))
    await worker.tasks.ensure_group()
    assert await worker.tasks.read(10, block_ms=0) == []  # running: its own backlog of a past run re-read
    yield worker
    await worker.loops.close()  # a hand-off started by a test's prefill
    await worker.redis.aclose()


async def _send(worker: Worker, request_id: str) -> str:
    request = GenerateRequest(request_id, "tiny", [97, 98], SamplingParams(max_tokens=4), "api", 0)
    return await add(worker.redis, worker.keys.tasks(worker.id), Task("prefill", request, "d1"))


def _queued(worker: Worker) -> list[str]:
    return [seq.request_id for seq in worker.requests.of(Status.QUEUED)]


async def test_a_task_read_while_the_worker_settles_a_lapsed_lease_is_taken(worker: Worker) -> None:
    # Back from a stop, the worker drops what the reaper moved while its task read is still
    # blocked. A task written meanwhile (a scheduler placed it on the rejoining worker) comes
    # back on that read: it must be taken, not added to a backlog that was replaced.
    feeding = asyncio.create_task(worker.feed.feed_tasks())
    await asyncio.sleep(0.1)  # the read is blocked in XREADGROUP
    await worker.feed.drop_moved()
    await _send(worker, "r-during")
    await asyncio.wait_for(feeding, 5)
    assert _queued(worker) == ["r-during"]


async def test_tasks_delivered_to_a_read_whose_reply_was_lost_are_taken_once(
    worker: Worker, bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a stop longer than the socket timeout, redis-py drops the reply of the read that
    # was waiting; Redis has delivered its entries to this worker, and nobody claims a live
    # worker's entries. The worker finds them pending with it and takes them (each once).
    first, second = await _send(worker, "r-lost-1"), await _send(worker, "r-lost-2")
    other = aioredis.Redis.from_url(bus_config.redis_url)
    await other.xreadgroup(WORKER_GROUP, worker.id, {worker.keys.tasks(worker.id): ">"}, count=10)  # the lost reply
    await other.aclose()
    real_read = worker.tasks.read

    async def timed_out(capacity: int, block_ms: int | None = None) -> list[object]:
        monkeypatch.setattr(worker.tasks, "read", real_read)
        raise RedisTimeout("Timeout reading from 127.0.0.1")

    monkeypatch.setattr(worker.tasks, "read", timed_out)
    with pytest.raises(RedisTimeout):
        await worker.feed.feed_tasks()
    await worker.feed.feed_tasks()
    assert _queued(worker) == ["r-lost-1", "r-lost-2"]
    assert [seq.entry_id for seq in worker.requests.of(Status.QUEUED)] == [first, second]
    assert worker.feed.known_entries() == {first, second}


async def test_a_lost_task_brought_again_by_its_read_is_taken_once(worker: Worker) -> None:
    # The look for lost tasks can run while a read's reply is still on its way: the same
    # entry then arrives twice, and only one copy becomes a request.
    entry = await _send(worker, "r-twice")
    (delivery,) = await worker.tasks.read(10, block_ms=0)  # delivered; its reply not handled yet
    await worker.feed.take_lost()  # finds it pending and unseen: takes it
    assert [d.entry_id for d in worker.feed.unaccepted] == [entry]
    worker.feed.unaccepted.append(delivery)  # then the reply is handled
    await worker.feed.feed_tasks()
    assert _queued(worker) == ["r-twice"] and [s.entry_id for s in worker.requests.of(Status.QUEUED)] == [entry]


async def test_a_request_moved_here_again_keeps_only_its_newest_task(worker: Worker) -> None:
    # Its decode worker died while this worker still had it queued; the reaper gave the
    # request a new pair with this same prefill worker. The older task is void: kept, it would
    # prefill twice, and retiring it later would close the newer one's result writer.
    older = await _send(worker, "r-again")
    await worker.feed.feed_tasks()
    free = worker.engine.free_blocks
    newer = await _send(worker, "r-again")
    await worker.feed.feed_tasks()
    assert [(s.request_id, s.entry_id) for s in worker.requests.of(Status.QUEUED)] == [("r-again", newer)]
    assert worker.outbox.done_entries == [older] and worker.engine.free_blocks == free
    await worker.steps.prefill_queued()
    assert worker.writer.next_seq("r-again") == 1  # the newer task's writer, open and written to


def _stall_worker(bus_config: BusConfig, tiny_model: Path) -> Worker:
    """A worker with a 1 s socket timeout and 300 ms reads, so a stall is short."""
    config = dataclasses.replace(bus_config, socket_timeout_s=1.0, block_ms=300)
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    return Worker(
        WorkerConfig(bus=config, role="prefill", model_dir=tiny_model, model_name="tiny", worker_id="p-stall"),
        tokenizer,
        SimEngine(SimConfig(), tokenizer, 64, 16),
    )


async def _running(worker: Worker, *steps: Callable[[], Awaitable[None]]) -> list[asyncio.Task[None]]:
    await worker.tasks.ensure_group()
    assert await worker.tasks.read(10, block_ms=0) == []  # running: its backlog re-read
    return [asyncio.create_task(forever(step, lambda: False, "test")) for step in steps]


async def _taken_within(worker: Worker, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while not worker.requests.of(Status.QUEUED) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return _queued(worker)


def _task_fields(request_id: str) -> dict[FieldT, EncodableT]:
    request = GenerateRequest(request_id, "tiny", [97, 98], SamplingParams(max_tokens=4), "api", 0)
    return fields(Task("prefill", request, "d1"))


async def test_a_task_whose_read_timed_out_in_a_stall_is_taken(bus_config: BusConfig, tiny_model: Path) -> None:
    # The real thing, not a stand-in: the worker's loop stalls (as under SIGSTOP) past the socket
    # timeout while its read is blocked, and Redis delivers a task to that read; redis-py times
    # the read out and drops its reply. The task is pending with the worker, unseen: the worker
    # looks for it after the failed read.
    worker = _stall_worker(bus_config, tiny_model)
    sender = redis.Redis.from_url(bus_config.redis_url)
    loops = await _running(worker, worker.feed.feed_tasks)
    try:
        await asyncio.sleep(0.1)  # the read is blocked in XREADGROUP
        threading.Timer(0.1, lambda: sender.xadd(bus_config.keys.tasks("p-stall"), _task_fields("r-stall"))).start()
        time.sleep(2.0)  # the whole loop stalls past the 1 s socket timeout
        assert await _taken_within(worker, 10) == ["r-stall"]
    finally:
        await cancel_and_wait(set(loops) | set(worker.loops.pending()))
        sender.close()
        await worker.redis.aclose()


async def test_a_task_lost_without_an_error_is_found_by_the_periodic_look(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    # A reply lost with no error reaching the worker (redis-py answering a timed-out read with
    # its retry's reply, as a client with default retries does): delivered to the worker's
    # consumer, never seen. The periodic look takes it once it is older than a read could be.
    worker = _stall_worker(bus_config, tiny_model)
    other = redis.Redis.from_url(bus_config.redis_url)
    loops = await _running(worker, worker.feed.find_lost_tasks)
    try:
        other.xadd(bus_config.keys.tasks("p-stall"), _task_fields("r-silent"))
        other.xreadgroup(WORKER_GROUP, "p-stall", {bus_config.keys.tasks("p-stall"): ">"}, count=1)  # the lost reply
        await asyncio.sleep(0.5)
        assert worker.feed.unaccepted == deque() and not worker.requests.of(
            Status.QUEUED
        )  # a read in flight is not raced
        await asyncio.wait_for(_until_unaccepted(worker), 10)
        await worker.feed.feed_tasks()
        assert _queued(worker) == ["r-silent"]
    finally:
        await cancel_and_wait(set(loops) | set(worker.loops.pending()))
        other.close()
        await worker.redis.aclose()


async def _until_unaccepted(worker: Worker) -> None:
    while not worker.feed.unaccepted:
        await asyncio.sleep(0.1)


async def test_a_decode_task_without_kv_room_waits_until_a_request_leaves(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    """A burst placed from a registry view older than the worker's last requests: the decode task
    it has no blocks for (a decode task takes them as it is taken) is read but not taken, and not
    failed; it is taken once a request leaves. Tasks that prefill take none until they start."""
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(bus=bus_config, role="decode", model_dir=tiny_model, model_name="tiny", worker_id="d2")
    worker = Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 16, 16))
    await worker.tasks.ensure_group()
    try:
        for rid in ("a", "b", "c"):  # 100 + 4 tokens each: 7 of the worker's 16 blocks
            request = GenerateRequest(rid, "tiny", [97] * 100, SamplingParams(max_tokens=4), "api", 0)
            await add(worker.redis, worker.keys.tasks(worker.id), Task("decode", request, "p1"))
        feeding = asyncio.create_task(worker.feed.feed_tasks())
        await asyncio.sleep(0.3)
        assert _awaiting(worker) == ["a", "b"] and not feeding.done()  # waiting for room: c read, not taken
        assert [d.message.request.request_id for d in worker.feed.unaccepted] == ["c"]
        assert worker.writer.pending == 0  # nothing failed
        first = worker.requests.get("a")
        assert first is not None and worker.requests.remove(first)
        worker.apply(worker.core.retire(first))  # a leaves: its blocks are free
        await asyncio.wait_for(feeding, 5)
        await worker.feed.feed_tasks()
        assert _awaiting(worker) == ["b", "c"]
    finally:
        await worker.loops.close()
        await worker.redis.aclose()


def _awaiting(worker: Worker) -> list[str]:
    return [seq.request_id for seq in worker.requests.of(Status.AWAITING_KV)]


async def test_queued_prefills_hold_no_blocks_until_their_prefill_starts(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(bus=bus_config, role="prefill", model_dir=tiny_model, model_name="tiny", worker_id="p3")
    worker = Worker(config, tokenizer, SimEngine(SimConfig(prefill_s_per_token=0), tokenizer, 16, 16))
    await worker.tasks.ensure_group()
    try:
        for rid, token in (("a", 97), ("b", 98)):  # 150 tokens each: 10 of the worker's 16 blocks
            request = GenerateRequest(rid, "tiny", [token] * 150, SamplingParams(max_tokens=4), "api", 0)
            await add(worker.redis, worker.keys.tasks(worker.id), Task("prefill", request, "d1"))
        await worker.feed.feed_tasks()
        assert _queued(worker) == ["a", "b"] and worker.engine.free_blocks == 16  # both taken, no blocks held
        batch = worker.core.plan_prefill()
        assert [s.request_id for s in batch] == ["a"] and _queued(worker) == ["b"]  # b waits for blocks
        assert worker.engine.free_blocks == 6
    finally:
        await worker.loops.close()
        await worker.redis.aclose()


async def test_an_engine_error_as_a_task_is_taken_fails_that_task_alone_and_keeps_what_came_before(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The request moved here again; taking its newer task raises in the engine after the older
    # task left the table. The older task is still acked, the newer one dead-lettered with the
    # error, and its request answered: nothing the core did before the error is lost.
    older = await _send(worker, "r-bug")
    await worker.feed.feed_tasks()

    def broken(task: object) -> int:
        raise RuntimeError("engine bug")

    monkeypatch.setattr(worker.engine, "cached_prefix", broken)
    newer = await _send(worker, "r-bug")
    await worker.feed.feed_tasks()
    assert worker.requests.of() == [] and worker.engine.free_blocks == 64
    await worker.publisher.publish()
    assert await worker.tasks.pending_ids() == set()  # the older acked, the newer dead-lettered
    letters = [codec.decode(fields) for _, fields in await worker.redis.xrange(worker.keys.dead)]
    assert [(letter.entry_id, letter.reason) for letter in letters] == [
        (newer, "handler_failed: RuntimeError: engine bug")
    ]
    assert older != newer
    (failed,) = await decoded(worker.redis, worker.keys.out("api", "r-bug"))
    assert isinstance(failed, Failed) and failed.code == "handler_failed"
