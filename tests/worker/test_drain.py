"""A worker's drain (splitbus/worker/drain.py) on a real core: with Redis's answers given, what it
waits for before it says it is done and how it ends (drained, or past its bound); against real
Redis, its flag (``Registry.show_draining``): a beat built before the flag and written after it
writes ``draining=0`` back, the next poll writes the flag again, and the drain is done only once
the hash shows it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.loops import Loops
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.core import Limits, WorkerCore
from splitbus.worker.drain import Drain
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.worker import Worker
from tests.worker import replies
from tests.worker.test_core import BLOCKS, FREE, taken, task


@pytest.fixture
def core(tiny_model: Path) -> WorkerCore:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    return WorkerCore(Limits("w1", "tiny", 16, kv_wait_s=30.0), SimEngine(FREE, tokenizer, BLOCKS, 16), tokenizer)


class Answers:
    """What the drain's reads give: ``flag`` raises while ``refusing``, and says whether the hash
    shows the flag (``shown``)."""

    def __init__(self) -> None:
        self.refusing, self.shown, self.flags, self.unsettled, self.unwritten = False, True, 0, 0, 0

    async def flag(self) -> bool:
        if self.refusing:
            raise RedisConnectionError("refused")
        self.flags += 1
        return self.shown

    async def count_unsettled(self) -> int:
        if self.refusing:
            raise RedisConnectionError("refused")
        return self.unsettled


def _drain(core: WorkerCore, answers: Answers, loops: Loops | None = None) -> Drain:
    return Drain(core, loops or Loops("w1"), answers.flag, answers.count_unsettled, lambda: answers.unwritten)


async def test_done_only_once_flagged_and_nothing_is_held_unwritten_or_unsettled(core: WorkerCore) -> None:
    answers = Answers()
    drain = _drain(core, answers)
    answers.refusing = True
    assert not await drain.drained()  # the flag is not in the hash yet: a task may still come
    answers.refusing, answers.shown = False, False
    assert not await drain.drained() and answers.flags == 1  # the hash does not show it (yet)
    answers.shown, answers.unwritten = True, 2
    assert not await drain.drained() and answers.flags == 2
    answers.unwritten, answers.unsettled = 0, 1  # a task read and not yet taken, or not yet acked
    assert not await drain.drained()
    answers.unsettled = 0
    assert await drain.drained() and answers.flags == 4  # the flag is read back at every poll
    taken(core, "1-0", task("mixed"))
    assert not await drain.drained()  # a request held


async def test_a_bug_in_a_read_is_not_taken_for_redis_refusing(core: WorkerCore) -> None:
    async def broken() -> int:
        raise KeyError("bug")

    drain = Drain(core, Loops("w1"), Answers().flag, broken, lambda: 0)
    with pytest.raises(KeyError):
        await drain.drained()


async def test_a_drain_that_finishes_stops_the_worker_and_a_second_signal_starts_none(
    core: WorkerCore, caplog: pytest.LogCaptureFixture
) -> None:
    loops = Loops("w1")
    drain = _drain(core, Answers(), loops)
    caplog.set_level(logging.INFO, "splitbus.worker.drain")
    drain.begin(30)
    drain.begin(30)
    await asyncio.wait_for(loops.stopping.wait(), 5)
    assert core.draining and core.load().draining == 1
    assert [r.getMessage() for r in caplog.records] == [
        "worker w1 draining: no new task; up to 30.0 s to finish 0 requests and 0 tasks not yet done",
        "worker w1 drained: leaving the registry",
    ]
    drain.begin(30)  # stopped: nothing more
    await loops.close()


async def test_past_its_bound_a_drain_stops_with_work_held_for_the_reaper(
    core: WorkerCore, caplog: pytest.LogCaptureFixture
) -> None:
    loops = Loops("w1")
    taken(core, "1-0", task("mixed"))
    caplog.set_level(logging.INFO, "splitbus.worker.drain")
    await asyncio.wait_for(_drain(core, Answers(), loops).run(0.3), 5)
    assert loops.stopped and core.held() == 1
    assert "drained: 1 requests handed over by migration after 0.3 s" in caplog.text


@pytest.mark.parametrize(
    ("left", "said"),
    [
        ({"unsettled": 1}, "1 tasks unread or unacked"),
        ({"unwritten": 2}, "2 results unwritten"),
        ({"shown": False}, "the flag not shown in its hash"),
    ],
)
async def test_a_drain_past_its_bound_holding_nothing_but_not_drained_says_what_is_left_and_does_not_leave(
    core: WorkerCore, caplog: pytest.LogCaptureFixture, left: dict[str, object], said: str
) -> None:
    """A task read but not taken is held by no request: the drain must not take 'nothing held'
    for drained, or the worker would deregister and orphan it (no reaper looks at one)."""
    answers, loops = Answers(), Loops("w1")
    for name, value in left.items():
        setattr(answers, name, value)
    drain = _drain(core, answers, loops)
    caplog.set_level(logging.INFO, "splitbus.worker.drain")
    await asyncio.wait_for(drain.run(0.3), 5)
    assert loops.stopped and core.held() == 0
    assert not drain.finished and drain.unfinished
    (end,) = [r.getMessage() for r in caplog.records if "not drained" in r.getMessage()]
    assert end == f"worker w1 not drained after 0.3 s: {said}; it resigns, for the reaper to move what is left"
    assert "leaving the registry" not in caplog.text


async def test_a_drain_that_finished_may_leave_the_registry(core: WorkerCore) -> None:
    drain = _drain(core, Answers())
    assert not drain.unfinished  # no drain began
    await asyncio.wait_for(drain.run(30), 5)
    assert drain.finished and not drain.unfinished


LEASE_MS = 60_000


async def _none() -> int:
    return 0


def _core(tiny_model: Path, worker_id: str = "d0") -> WorkerCore:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    return WorkerCore(Limits(worker_id, "tiny", block_size=16), SimEngine(FREE, tokenizer, 32, 16), tokenizer)


async def test_a_late_beat_that_writes_the_flag_back_to_0_is_undone_at_the_next_poll(
    redis: aioredis.Redis, bus_config: BusConfig, tiny_model: Path
) -> None:
    core = _core(tiny_model)
    registry, hash_key = Registry(redis, bus_config), bus_config.keys.worker("d0")
    await registry.register(WorkerRecord("d0", "decode", "tiny", load=core.load()), LEASE_MS)
    late = core.load()  # a beat's load, built before the flag
    core.draining = True
    drain = Drain(core, Loops("worker d0"), lambda: registry.show_draining("d0", core.load()), _none, lambda: 0)

    assert not await drain.drained()  # the hash did not show the flag yet: written now
    assert await redis.hget(hash_key, "draining") == b"1"
    assert await drain.drained()  # shown: nothing held, unread or unwritten

    await registry.heartbeat("d0", late, LEASE_MS)  # the late beat: draining=0 again
    assert await redis.hget(hash_key, "draining") == b"0" and late.draining == 0
    assert not await drain.drained()  # not done while the hash says 0
    assert await redis.hget(hash_key, "draining") == b"1"
    assert await drain.drained()


async def test_the_flag_shown_writes_nothing(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    registry = Registry(redis, bus_config)
    record = WorkerRecord("d1", "decode", "tiny")
    await registry.register(dataclasses.replace(record, load=dataclasses.replace(record.load, draining=1)), LEASE_MS)
    log_length = await redis.xlen(registry.log_key)
    assert await registry.show_draining("d1", record.load)  # the load given (draining=0) is not written
    assert await redis.xlen(registry.log_key) == log_length
    assert await redis.hget(bus_config.keys.worker("d1"), "draining") == b"1"


@pytest.mark.parametrize(
    ("bound_s", "stopped_first", "said"),
    [
        (0.0, False, "drained: 2 requests handed over by migration after 0.0 s"),
        (30.0, True, "worker d0 stopped while draining, holding 2 requests"),
    ],
)
async def test_the_end_of_a_drain_says_migration_only_once_the_bound_has_passed(
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    bound_s: float,
    stopped_first: bool,
    said: str,
) -> None:
    """Stopped before its bound (SIGINT) a worker did not wait the bound out: no 'after S s'."""
    core, loops = _core(tiny_model), Loops("worker d0")
    monkeypatch.setattr(core, "held", lambda: 2)
    if stopped_first:
        loops.stop()

    async def shown() -> bool:
        return True

    with caplog.at_level(logging.INFO, logger="splitbus.worker.drain"):
        await Drain(core, loops, shown, _none, lambda: 0).run(bound_s)
    messages = [r.getMessage() for r in caplog.records if r.name == "splitbus.worker.drain"]
    assert said in messages and loops.stopped
    assert stopped_first == all("migration" not in m for m in messages)


async def test_a_worker_whose_drain_did_not_finish_resigns_instead_of_leaving_the_registry(
    redis: aioredis.Redis, bus_config: BusConfig, tiny_model: Path
) -> None:
    """Its drain ends holding nothing, with a task in its stream never read: the worker keeps its
    record (without a lease), for the reaper to move that task."""
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(bus=bus_config, role="mixed", model_dir=tiny_model, model_name="tiny", worker_id="d2")
    worker = Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 64, 16))
    await worker.tasks.ensure_group()
    await worker.registry.register(worker.record(), LEASE_MS)
    request = GenerateRequest("r-unread", "tiny", [97, 98], SamplingParams(max_tokens=4), "api", 0)
    await replies.add(redis, bus_config.keys.tasks("d2"), Task("mixed", request))
    await asyncio.wait_for(worker.draining.run(0.3), 5)
    assert worker.exit_code == 0 and worker.core.held() == 0 and worker.draining.unfinished
    await worker.close()
    assert await redis.exists(bus_config.keys.worker("d2")) == 1  # still there, for the reaper
    assert await redis.exists(bus_config.keys.lease("d2")) == 0  # resigned
