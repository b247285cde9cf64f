"""The engine's steps (splitbus/worker/steps.py), against a real Redis: what a step does when
Redis refuses in the middle of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import TokenDelta
from splitbus.worker.steps import DecodeClock
from splitbus.worker.table import Status
from tests.worker.test_stepper import entries, mixed_worker, queue


async def test_a_prefill_that_redis_interrupts_keeps_its_batch_to_prefill_again(
    bus_config: BusConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A transient Redis error inside the prefill step (here the lease check after the engine
    # call) goes to the loop, which waits it out. The batch must still be held: taken out of the
    # table it was lost, its blocks never freed, its tasks never acked or failed.
    worker = mixed_worker(bus_config, tiny_model)
    first, second, later = queue(worker, "r-1", entry="1-0"), queue(worker, "r-2", entry="2-0"), None
    free = worker.engine.free_blocks

    async def redis_refuses() -> None:
        raise RedisConnectionError("Redis restarting")

    monkeypatch.setattr(worker.steps, "settle", redis_refuses)  # the lease check it was given
    try:
        with pytest.raises(RedisConnectionError):
            await worker.steps.prefill_queued()
        later = queue(worker, "r-3", entry="3-0")  # taken while the loop waited Redis out
        assert worker.requests.of(Status.QUEUED) == [first, second, later]  # the batch first, as before
        assert first.blocks > 0 and second.blocks > 0  # taken as the prefill started
        assert worker.engine.free_blocks == free - first.blocks - second.blocks  # and kept
        monkeypatch.undo()
        await worker.steps.prefill_queued()
        assert [worker.requests.status(s) for s in (first, second, later)] == [Status.RUNNING] * 3
        assert [type(e) for e in await entries(worker, "r-1")] == [TokenDelta]  # one first token, not two
    finally:
        await worker.loops.close()
        await worker.redis.aclose()


async def test_a_poisoned_request_whose_dead_letter_raises_stays_held(
    bus_config: BusConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine fails on one request: it is dead-lettered and failed. Should the dead letter
    # raise, the request stays queued (prefilled again), not out of the table with no answer.
    worker = mixed_worker(bus_config, tiny_model)
    seq = queue(worker, "r-poison")

    async def engine_fails(batch: object) -> list[int]:
        raise ValueError("bad request")

    async def letter_refused(*args: object) -> None:
        raise RedisConnectionError("Redis restarting")

    monkeypatch.setattr(worker.engine, "prefill", engine_fails)
    monkeypatch.setattr(worker.tasks, "dead_letter", letter_refused)
    try:
        with pytest.raises(RedisConnectionError):
            await worker.steps.prefill_queued()
        assert worker.requests.of(Status.QUEUED) == [seq] and seq.blocks
    finally:
        await worker.loops.close()
        await worker.redis.aclose()


def test_the_decode_clock_counts_each_step_to_the_next_and_a_spells_last_to_its_end() -> None:
    counters = dict.fromkeys(("decode_time_us", "decode_steps", "decode_tokens_done"), 0)
    clock = DecodeClock(counters)
    clock.step_starts(10.0)
    clock.step_ends(10.1, tokens=4)
    clock.step_starts(10.5)  # a prefill ran in between: the requests waited for it too
    clock.step_ends(10.6, tokens=3)
    clock.idle()  # nothing more runs: the last step counts to its own end
    clock.idle()
    assert counters == {"decode_time_us": 600_000, "decode_steps": 2, "decode_tokens_done": 7}
    clock.step_starts(20.0)  # a new spell: the idle time before it is not counted
    clock.step_ends(20.2, tokens=1)
    clock.idle()
    assert counters == {"decode_time_us": 800_000, "decode_steps": 3, "decode_tokens_done": 8}


async def test_steps_count_prefill_busy_time_and_decode_steps_and_tokens(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    worker = mixed_worker(bus_config, tiny_model)
    queue(worker, "r-1", entry="1-0")
    queue(worker, "r-2", entry="2-0")
    try:
        assert await worker.steps.prefill_queued()
        assert await worker.steps.decode_running()
        load = worker.core.load()
        assert load.prefill_busy_us > 0 and load.prompt_tokens_done > 0
        assert (load.decode_steps, load.decode_tokens_done) == (1, 2)
        assert load.decode_time_us == 0  # the step is counted when the next one starts or the spell ends
        while await worker.steps.decode_running():
            pass
        assert worker.core.load().decode_time_us > 0
    finally:
        await worker.loops.close()
        await worker.redis.aclose()
