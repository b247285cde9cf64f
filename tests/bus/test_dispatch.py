"""The dispatch protocol's own rules (the script against real Redis: tests/placement/test_dispatcher.py)."""

from __future__ import annotations

import re

import orjson
import pytest
import redis.asyncio as aioredis

from splitbus.bus import dispatch
from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import SCHEDULER_GROUP
from splitbus.bus.core.streams import GroupConsumer, Producer
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.bus.messages.tasks import RequestJson, task_json
from splitbus.bus.records import Reserved, WorkerLoad, blocks_needed
from splitbus.bus.registry import LOAD_FIELDS, Registry, WorkerRecord
from splitbus.placement.decision import Placement
from splitbus.placement.dispatcher import Dispatcher
from tests.placement.snapshot import request, tasks_in, worker


def test_the_script_builds_no_key_name() -> None:
    """Every key it touches comes in KEYS (Redis Cluster routes a script by them)."""
    lua = dispatch._DISPATCH.source
    assert ".." not in lua and "sb:" not in lua
    touched = re.findall(r"redis\.call\('\w+', (\w+)", lua)
    assert touched and all(name in ("KEYS", "worker", "tasks") for name in touched)
    assert "local worker, tasks, a = KEYS[6 + 3 * i], KEYS[7 + 3 * i]" in lua


def test_entries_are_named_by_the_keys_module(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    keys = bus_config.keys
    script = dispatch.DispatchScript(redis, bus_config, 60)
    first = script.request_entry("1-0", "r")
    assert (first.stream, first.mark) == (keys.requests, keys.dispatched("r"))
    moved = script.task_entry("p", "2-0", "r")
    assert (moved.stream, moved.mark) == (keys.tasks("p"), keys.dispatched("r:2-0"))


def test_a_request_reserves_the_blocks_of_its_prompt_and_its_longest_answer() -> None:
    request = GenerateRequest("r", "m", [1] * 100, SamplingParams(max_tokens=28), "api", 0)
    assert [blocks_needed(request, size) for size in (16, 128, 0)] == [8, 1, 128]


def test_the_draining_flag_the_script_reads_is_a_load_field_of_the_worker_hash() -> None:
    assert dispatch.DRAINING_FIELD in LOAD_FIELDS
    assert dispatch.DispatchOutcome.WORKER_DRAINING in dispatch.PLACE_AGAIN


async def test_no_task_is_written_for_a_draining_worker(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    """A placement made from a registry view read before the decode worker set its draining flag:
    the script writes nothing (not P's task either, nor a reservation) and the entry stays
    pending, to be placed again; once the flag is cleared (a restarted worker), it dispatches."""
    registry = Registry(redis, bus_config)
    for wid, role in (("p", "prefill"), ("d", "decode")):
        await registry.register(WorkerRecord(worker_id=wid, role=role, model="m"), 5000)
    consumer = GroupConsumer(redis, bus_config, bus_config.keys.requests, SCHEDULER_GROUP, "s1")
    await consumer.ensure_group()
    await Producer(redis, bus_config).send(bus_config.keys.requests, request())
    delivery = (await consumer.read(1))[0]
    plan = [
        Placement(worker("d", "decode"), "decode", "p", Reserved(0, 1, 8)),
        Placement(worker("p", "prefill"), "prefill", "d", Reserved(100, 0, 0)),
    ]
    dispatcher = Dispatcher(redis, bus_config, 60)
    await registry.heartbeat("d", WorkerLoad(draining=1), 5000)
    outcome = await dispatcher.dispatch(delivery.entry_id, delivery.message, plan, "s1")
    assert outcome is dispatch.DispatchOutcome.WORKER_DRAINING
    assert outcome.label == "worker_draining"
    assert [await redis.xlen(bus_config.keys.tasks(w)) for w in ("p", "d")] == [0, 0]
    assert {w.record.worker_id: w.reserved for w in await registry.snapshot()} == dict.fromkeys("pd", Reserved())
    assert await redis.get(bus_config.keys.current("r")) is None
    assert (await redis.xpending(bus_config.keys.requests, SCHEDULER_GROUP))["pending"] == 1
    await registry.heartbeat("d", WorkerLoad(draining=0), 5000)
    assert (
        await dispatcher.dispatch(delivery.entry_id, delivery.message, plan, "s1")
        is dispatch.DispatchOutcome.DISPATCHED
    )


def test_a_tasks_data_is_what_encoding_the_task_gives() -> None:
    """The dispatch writes each task's JSON with its request's JSON encoded once per dispatch
    (``task_json``): the very bytes ``orjson.dumps`` of the task gives (docs/redis-cli.md shows
    them), for every phase."""
    req = GenerateRequest(
        "r", "m", [5, 6, 7], SamplingParams(max_tokens=3, stop=["x"], logit_bias={"5": 1.5}), "api", 9, tenant="t"
    )
    shared = RequestJson()
    for task in (
        Task("prefill", req, "d", reserved=[3, 0, 0], handoff="h", twins=2),
        Task("decode", req, "p", 4, [1, 2], "b", 2, [0, 1, 8], "h"),
        Task("mixed", req),
    ):
        data = task_json(task, shared)
        assert data == orjson.dumps(task)
        assert codec.decode({b"type": b"task", b"data": data, b"ts": b"1"}) == task


def test_a_dispatch_encodes_its_request_once() -> None:
    req, other = request(), request(prompt=7)
    shared = RequestJson()
    assert shared.of(req) is shared.of(req)
    assert shared.of(other) is not shared.of(req)


async def test_tasks_go_to_their_workers_past_the_cache_of_encoded_keys(
    redis: aioredis.Redis, bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script's per-worker keys are encoded once per worker and kept; past the bound the cache
    starts again, and every dispatch still reaches its own workers."""
    monkeypatch.setattr(dispatch, "MAX_CACHED_WORKERS", 2)
    registry = Registry(redis, bus_config)
    for wid in ("p1", "d1", "p2", "d2"):
        await registry.register(
            WorkerRecord(worker_id=wid, role="prefill" if wid[0] == "p" else "decode", model="m"), 5000
        )
    dispatcher = Dispatcher(redis, bus_config, 60)
    for n, (p, d) in enumerate((("p1", "d1"), ("p2", "d2"), ("p1", "d2"))):
        plan = [
            Placement(worker(d, "decode"), "decode", p, Reserved(0, 1, 8)),
            Placement(worker(p, "prefill"), "prefill", d, Reserved(100, 0, 0)),
        ]
        req = GenerateRequest(f"r{n}", "m", [1] * 100, SamplingParams(max_tokens=28), "api", 0)
        assert await dispatcher.dispatch_direct(req, plan) is dispatch.DispatchOutcome.DISPATCHED
    for wid, requests in (("p1", ["r0", "r2"]), ("d1", ["r0"]), ("p2", ["r1"]), ("d2", ["r1", "r2"])):
        assert [t.request.request_id for t in await tasks_in(redis, bus_config.keys.tasks(wid))] == requests
    assert len(dispatcher._script._workers) <= 2
