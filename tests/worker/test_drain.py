"""A worker's drain (splitbus/worker/drain.py) on a real core, with Redis's answers given: what
it waits for before it says it is done, and how it ends (drained, or past its bound)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.core.loops import Loops
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.core import Limits, WorkerCore
from splitbus.worker.drain import Drain
from splitbus.worker.engines.sim import SimEngine
from tests.worker.test_core import BLOCKS, FREE, taken, task


@pytest.fixture
def core(tiny_model: Path) -> WorkerCore:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    return WorkerCore(Limits("w1", "tiny", 16, kv_wait_s=30.0), SimEngine(FREE, tokenizer, BLOCKS, 16), tokenizer)


class Answers:
    """What the drain's reads give: ``flag`` raises while ``refusing``."""

    def __init__(self) -> None:
        self.refusing, self.flags, self.unsettled, self.unwritten = False, 0, 0, 0

    async def flag(self) -> None:
        if self.refusing:
            raise RedisConnectionError("refused")
        self.flags += 1

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
    answers.refusing, answers.unwritten = False, 2
    assert not await drain.drained() and answers.flags == 1
    answers.unwritten, answers.unsettled = 0, 1  # a task read and not yet taken, or not yet acked
    assert not await drain.drained()
    answers.unsettled = 0
    assert await drain.drained() and answers.flags == 1  # the flag is written once
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
