"""A worker publishes its prefix cache's KV events (docs/routing.md, "KV events"), against a real
Redis: a fresh cache at start, what each step stored and evicted, kept while Redis refuses, and
a snapshot after a new Redis run; a scheduler's index fed from its stream and snapshot."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.blocks import block_hashes
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.streams import Producer
from splitbus.bus.kv_events import KvEventReader
from splitbus.bus.messages import Finished, GenerateRequest, SamplingParams, Task
from splitbus.bus.messages.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    block_hash,
)
from splitbus.bus.results import ResultReader, Subscription
from splitbus.bus.runs import Runs
from splitbus.placement.kv_index import KvIndex, KvIndexFeeder
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.worker import Worker
from tests.worker.replies import decoded

FIRST = list(range(1, 41))  # two full blocks of 16, then 8 tokens
SECOND = list(range(50, 90))


def sim_worker(bus_config: BusConfig, tiny_model: Path, blocks: int, dp_rank: int = -1) -> Worker:
    """A mixed sim worker ``k0`` with ``blocks`` KV blocks of 16 tokens."""
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(
        bus=bus_config,
        role="mixed",
        model_dir=tiny_model,
        model_name="tiny",
        worker_id="k0",
        dp_group="g0" if dp_rank >= 0 else "",
        dp_rank=dp_rank,
        dp_size=dp_rank + 1,
    )
    return Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, blocks, 16))


def chain(tokens: list[int]) -> list[str]:
    return [block_hash(h) for h in block_hashes(tokens, 16)]


async def events(redis: aioredis.Redis, bus_config: BusConfig) -> list[KvEvent]:
    batches = [b for b in await decoded(redis, bus_config.keys.kv_events("k0")) if isinstance(b, KvEventBatch)]
    assert [b.event_id for b in batches] == list(range(1, len(batches) + 1))
    return [e for b in batches for e in b.events]


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def serve(worker: Worker, reader: ResultReader, request_id: str, prompt: list[int]) -> None:
    """One request of ``prompt`` with 2 tokens to generate, to its Finished entry."""
    config = worker.config.bus
    request = GenerateRequest(
        request_id, "tiny", prompt, SamplingParams(max_tokens=2), "api", 0, reader=reader.reader_of(request_id)
    )
    sub: Subscription = await reader.subscribe(request_id)
    await Producer(worker.redis, config).send(config.keys.tasks(worker.id), Task("mixed", request))
    entries = await asyncio.wait_for(_drain(sub), 10)
    assert isinstance(entries[-1], Finished)


async def _drain(sub: Subscription) -> list[object]:
    return [result async for result in sub]


async def test_a_worker_publishes_what_it_stores_and_evicts_and_an_index_follows(
    bus_config: BusConfig, tiny_model: Path, redis: aioredis.Redis
) -> None:
    worker = sim_worker(bus_config, tiny_model, blocks=3)  # the second request evicts the first's blocks
    running = asyncio.create_task(worker.run())
    reader = ResultReader(bus_config, worker.redis, name="api-kv")
    index = KvIndex()
    feeder = KvIndexFeeder(index, KvEventReader(redis, bus_config))
    try:
        await reader.start()
        await serve(worker, reader, "r1", FIRST)

        async def stored() -> bool:
            return len(await events(redis, bus_config)) == 2

        await until(stored)
        assert await events(redis, bus_config) == [AllBlocksCleared(), BlockStored(chain(FIRST), "", 16)]
        await feeder.poll(["k0"])
        assert index.overlap("k0", chain(FIRST)) == 2 and index.dp_rank("k0") == -1

        await serve(worker, reader, "r2", SECOND)  # 3 blocks: the plain one, then both cached ones

        async def evicted() -> bool:
            return len(await events(redis, bus_config)) == 4

        await until(evicted)
        assert (await events(redis, bus_config))[2:] == [
            BlockRemoved(chain(FIRST)[::-1]),  # the prefix's tail first
            BlockStored(chain(SECOND), "", 16),
        ]
        await feeder.poll(["k0"])
        assert index.overlap("k0", chain(FIRST)) == 0 and index.overlap("k0", chain(SECOND)) == 2
    finally:
        await reader.close()
        worker.stopping.set()
        await asyncio.wait_for(running, 10)


async def test_events_redis_refused_stay_buffered_and_a_new_run_writes_the_snapshot(
    bus_config: BusConfig, tiny_model: Path, redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = sim_worker(bus_config, tiny_model, blocks=8, dp_rank=1)
    publisher, pool = worker.publisher, worker.engine.kv_events
    assert pool is not None and isinstance(worker.engine, SimEngine)
    try:
        await publisher.publish()  # not started: nothing goes out
        assert await redis.exists(bus_config.keys.kv_events("k0")) == 0
        await publisher.start_kv_events()
        got = worker.engine.pool.allocate(3, FIRST)
        assert got is not None
        worker.engine.pool.store(got.table, FIRST)
        send = publisher.kv.publish

        async def refused(batch: list[KvEvent]) -> int:
            raise RedisConnectionError("Redis is away")

        monkeypatch.setattr(publisher.kv, "publish", refused)
        with pytest.raises(RedisConnectionError):
            await publisher.publish()
        assert pool.pending() == [BlockStored(chain(FIRST), "", 16)]  # kept for the next write
        monkeypatch.setattr(publisher.kv, "publish", send)
        await publisher.publish()
        assert len(pool) == 0
        batches = await decoded(redis, bus_config.keys.kv_events("k0"))
        assert [(b.event_id, b.dp_rank, b.events) for b in batches if isinstance(b, KvEventBatch)] == [
            (1, 1, [AllBlocksCleared()]),
            (2, 1, [BlockStored(chain(FIRST), "", 16)]),
        ]
        snapshots = KvEventReader(redis, bus_config)
        before = (await snapshots.snapshots(["k0"]))["k0"]
        assert before is not None and before.event_id == 1  # the first one; the next is due in 30 s

        async def new_run() -> Runs:
            return Runs.NEW

        monkeypatch.setattr(worker.recovery.runs, "poll", new_run)
        await worker._watch_runs()  # what each heartbeat does first
        await publisher.publish()
        after = (await snapshots.snapshots(["k0"]))["k0"]
        assert after is not None and after.event_id == 2 and sorted(after.block_hashes) == sorted(chain(FIRST))
        assert not publisher.kv_new_run
        stream = bus_config.keys.kv_events("k0")
        await redis.delete(stream)  # the new run had lost it
        more = worker.engine.pool.allocate(3, SECOND)
        assert more is not None
        worker.engine.pool.store(more.table, SECOND)
        await publisher.publish()
        assert 0 < await redis.ttl(stream) <= 3600  # the recreated stream expires too
        index = KvIndex()  # a scheduler replica starting now: the snapshot, then batch 3
        await KvIndexFeeder(index, KvEventReader(redis, bus_config)).poll(["k0"])
        assert index.overlap("k0", chain(FIRST)) == 2 and index.overlap("k0", chain(SECOND)) == 2
    finally:
        await worker.redis.aclose()
