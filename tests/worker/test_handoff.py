"""The prefill side of the P -> D hand-off, against a real Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

from splitbus.bus.config import BusConfig
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.sequence import Sequence
from splitbus.worker.sim import SimEngine
from splitbus.worker.text import TextStream
from splitbus.worker.worker import Worker


async def test_prefill_waits_for_its_peers_reservation_not_a_dead_workers(bus_config: BusConfig, tiny_model: Path) -> None:
    # A request moved off a dead decode worker: that worker's reservation is still in sb:kv
    # when the new prefill task runs. P must wait for the new decode worker's, not send there.
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(bus=bus_config, role="prefill", model_dir=tiny_model, model_name="tiny", worker_id="p1")
    worker = Worker(config, tokenizer, SimEngine(config.sim, tokenizer, 64, 16))
    request = GenerateRequest("moved-1", "tiny", [97], SamplingParams(max_tokens=4), "api", 0)
    seq = Sequence(Task("prefill", request, peer="d2"), "1-0", TextStream(tokenizer, []))
    kv = bus_config.keys.kv("moved-1")
    await worker.redis.hset(kv, mapping={"decode_worker": "d1-dead", "endpoint": "127.0.0.1:1"})
    await worker.redis.set(bus_config.keys.lease("d2"), "1", px=10_000)

    async def new_reservation() -> None:
        await asyncio.sleep(0.2)
        await worker.redis.hset(kv, mapping={"decode_worker": "d2", "endpoint": "127.0.0.1:2"})

    writer = asyncio.create_task(new_reservation())
    try:
        assert await worker.wait_for_reservation(seq) == "127.0.0.1:2"
    finally:
        await writer
        await worker.redis.aclose()


async def test_a_retired_task_drops_only_its_own_reservation(bus_config: BusConfig, tiny_model: Path) -> None:
    # D retires the task of a request that moved here again: the old task's clean-up must not
    # delete the reservation the new task has just written (P would wait for it forever).
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(bus=bus_config, role="decode", model_dir=tiny_model, model_name="tiny", worker_id="d1")
    worker = Worker(config, tokenizer, SimEngine(config.sim, tokenizer, 64, 16))
    moved, done = bus_config.keys.kv("moved-2"), bus_config.keys.kv("done-3")
    try:
        await worker.redis.hset(moved, mapping={"decode_worker": "d1", "task_entry": "2-0"})  # the new task's
        await worker.redis.hset(done, mapping={"decode_worker": "d1", "task_entry": "3-0"})
        worker.stale_reservations += [(moved, "1-0"), (done, "3-0")]  # the old task of moved-2, and done-3's
        await worker.publish()
        assert await worker.redis.hget(moved, "task_entry") == b"2-0"
        assert not await worker.redis.exists(done)
        assert worker.stale_reservations == []
    finally:
        await worker.redis.aclose()
