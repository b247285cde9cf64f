"""The one way background loops run (splitbus/bus/core/loops.py): its error policy, pure logic."""

from __future__ import annotations

import asyncio
import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.core.loops import EXIT_FATAL, Loops


async def test_a_loop_that_fails_stops_the_process_non_zero_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    failed: list[bool] = []
    loops = Loops("worker w1", on_fail=lambda: failed.append(True))

    async def heartbeat() -> None:
        raise KeyError("a bug")

    loops.start(heartbeat)
    await asyncio.wait_for(loops.stopping.wait(), 5)
    assert (loops.exit_code, failed) == (EXIT_FATAL, [True])
    assert "worker w1: heartbeat failed" in caplog.text and "KeyError: 'a bug'" in caplog.text
    await loops.close()


async def test_a_transient_redis_error_is_waited_out_and_the_loop_goes_on() -> None:
    loops, calls = Loops("scheduler s1"), []

    async def step() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise RedisConnectionError("Redis restarting")
        if len(calls) == 5:
            loops.stop()

    await asyncio.wait_for(loops.run(step), 10)
    assert (len(calls), loops.exit_code) == (5, 0)


async def test_paced_loops_wait_between_steps_and_end_at_once_on_stop() -> None:
    loops, calls = Loops("api"), []

    async def refresh() -> None:
        calls.append(1)

    loops.start(refresh, every_s=60)
    await asyncio.sleep(0.05)
    assert len(calls) == 1  # the next step is a minute away
    await asyncio.wait_for(loops.close(), 3)  # close does not wait out the pace
    assert loops.exit_code == 0


async def test_one_shot_work_that_fails_is_logged_and_stops_nothing(caplog: pytest.LogCaptureFixture) -> None:
    loops = Loops("worker w2")

    async def hand_off() -> None:
        raise ValueError("escaped")

    await asyncio.gather(loops.spawn(hand_off()), return_exceptions=True)
    await asyncio.sleep(0)
    assert not loops.stopped and loops.exit_code == 0
    assert any(r.levelno == logging.ERROR and "background work failed" in r.getMessage() for r in caplog.records)
    await loops.close()


async def test_close_cancels_what_still_runs() -> None:
    loops = Loops("api")
    task = loops.spawn(asyncio.sleep(3600))
    await asyncio.wait_for(loops.close(), 3)
    assert task.cancelled()


async def test_close_from_one_shot_work_cancels_the_others_but_not_itself() -> None:
    # A part that stops its loops before its own last work (a DP rank leaving its group) calls
    # close() from inside that work: the loops end, the caller goes on to its last writes.
    loops, after = Loops("worker w3"), list[str]()
    loop_ran = asyncio.Event()

    async def feed() -> None:
        loop_ran.set()
        await asyncio.sleep(3600)

    async def leave() -> None:
        await loop_ran.wait()
        await loops.close()
        after.append("still running")

    loops.start(feed)
    leaving = loops.spawn(leave())
    await asyncio.wait_for(leaving, 3)
    assert after == ["still running"] and not leaving.cancelled()
    assert loops.stopped and loops.pending() == []


async def test_pending_lists_what_runs_and_drain_waits_for_one_shot_work_alone() -> None:
    loops, release = Loops("worker w4"), asyncio.Event()

    async def heartbeat() -> None:
        await asyncio.sleep(3600)

    async def hand_off() -> None:
        await release.wait()

    loops.start(heartbeat)
    work = loops.spawn(hand_off())
    await asyncio.sleep(0)
    assert len(loops.pending()) == 2 and work in loops.pending()
    draining = asyncio.create_task(loops.drain())
    await asyncio.sleep(0)
    assert not draining.done()  # the hand-off still runs
    release.set()
    await asyncio.wait_for(draining, 3)  # returns although the heartbeat loop runs on
    assert work.done() and len(loops.pending()) == 1
    await loops.close()
    assert loops.pending() == []
