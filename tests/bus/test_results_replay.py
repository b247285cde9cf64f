"""The result writer's replay: after a new Redis run, what a stream lost off its end is written
again from what the writer kept for the replay window, in ``seq`` order, and the reader sees an
exact sequence; a stream that lost more than the window holds ends with ``results_lost``."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis.asyncio as aioredis

from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import Failed, Finished, TokenDelta
from splitbus.bus.results import RESULTS_LOST, ResultReader, ResultWriter, Subscription

R = "api-replay.0"
"""The reader shard of streams a test writes without following them."""


class Clock:
    """A clock the test moves: the replay window is measured with it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _write(writer: ResultWriter, request_id: str, tokens: range, *, finish: bool = False) -> None:
    """One flush per token (each its own round, as engine steps are)."""
    for token in tokens:
        writer.tokens(request_id, [token], str(token))
        await writer.flush()
    if finish:
        writer.finish(request_id, "length", prompt_tokens=2, completion_tokens=len(tokens))
        await writer.flush()


async def _seqs(redis: aioredis.Redis, key: str) -> list[int]:
    return [codec.decode(fields).seq for _, fields in await redis.xrange(key)]


async def _lose_tail(redis: aioredis.Redis, key: str, count: int) -> None:
    """What a new run that kept a prefix leaves: the stream without its last ``count`` entries."""
    ids = [entry_id for entry_id, _ in await redis.xrevrange(key, count=count)]
    await redis.xdel(key, *ids)


async def _collect(sub: Subscription) -> list[object]:
    async def drain() -> list[object]:
        return [r async for r in sub]

    return await asyncio.wait_for(drain(), 20)


async def test_replay_writes_again_the_lost_tail_in_order(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    writer = ResultWriter(redis, bus_config)
    writer.open("r1", reader=R)
    await _write(writer, "r1", range(6), finish=True)
    key = bus_config.keys.out(R, "r1")
    await _lose_tail(redis, key, 3)
    assert await _seqs(redis, key) == [0, 1, 2, 3]
    assert await writer.replay() == 3
    assert await _seqs(redis, key) == [0, 1, 2, 3, 4, 5, 6]  # only what was lost, once
    reader = ResultReader(bus_config, redis, name="api-replay")
    await reader.start()
    try:
        assert reader.reader_of("r1") == R
        sub = await reader.subscribe("r1")
        results = await _collect(sub)
    finally:
        await reader.close()
    assert [r.seq for r in results] == list(range(7))  # type: ignore[attr-defined]
    assert results[:2] == [TokenDelta(0, [0], "0"), TokenDelta(1, [1], "1")]
    assert isinstance(results[-1], Finished)


async def test_replay_restores_a_deleted_stream_and_the_request_goes_on(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    writer = ResultWriter(redis, bus_config)
    writer.open("r2", reader=R)
    await _write(writer, "r2", range(3))
    key = bus_config.keys.out(R, "r2")
    await redis.delete(key)
    assert await writer.replay() == 3
    assert await _seqs(redis, key) == [0, 1, 2]
    assert await redis.ttl(key) > bus_config.finished_result_ttl_s  # a running request's stream: its long TTL
    await _write(writer, "r2", range(3, 5), finish=True)  # the writer goes on where it was
    assert await _seqs(redis, key) == [0, 1, 2, 3, 4, 5]


async def test_a_reader_that_had_the_entries_sees_no_duplicate(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    reader = ResultReader(bus_config, redis, name="api-dup")
    await reader.start()
    try:
        writer = ResultWriter(redis, bus_config)
        sub = await reader.subscribe("r3")
        writer.open("r3", reader=reader.reader_of("r3"))
        await _write(writer, "r3", range(4))
        got = [await asyncio.wait_for(sub.get(), 20) for _ in range(4)]
        await _lose_tail(redis, bus_config.keys.out(reader.reader_of("r3"), "r3"), 2)
        assert await writer.replay() == 2
        await _write(writer, "r3", range(4, 5), finish=True)
        got += await _collect(sub)
    finally:
        await reader.close()
    assert [r.seq for r in got] == [0, 1, 2, 3, 4, 5]  # type: ignore[attr-defined]
    assert [r.token_ids for r in got[:5]] == [[0], [1], [2], [3], [4]]  # type: ignore[attr-defined]


async def test_a_loss_beyond_the_window_fails_the_request_now(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    clock = Clock()
    writer = ResultWriter(redis, bus_config, clock=clock)
    writer.open("r4", reader=R)
    await _write(writer, "r4", range(3))  # seq 0-2, then out of the window
    clock.now += bus_config.replay_window_s + 1
    await _write(writer, "r4", range(3, 6))  # seq 3-5: kept
    assert writer.retained == 3
    key = bus_config.keys.out(R, "r4")
    await _lose_tail(redis, key, 4)  # seq 2-5 gone: 2 was not kept
    assert await writer.replay() == 1
    entries = [codec.decode(fields) for _, fields in await redis.xrange(key)]
    assert [e.seq for e in entries[:2]] == [0, 1]
    failed = entries[-1]
    assert isinstance(failed, Failed) and failed.code == RESULTS_LOST and failed.status == 503
    assert "replay window" in failed.message
    writer.tokens("r4", [6])  # still open here: the worker's writes go on (its reader has ended)
    await writer.flush()


async def test_a_stream_deleted_after_the_window_is_left_alone(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    """No stream and a start older than the window: its reader had the end and deleted it."""
    clock = Clock()
    writer = ResultWriter(redis, bus_config, clock=clock)
    writer.open("r5", reader=R)
    await _write(writer, "r5", range(2))
    clock.now += bus_config.replay_window_s + 1
    await _write(writer, "r5", range(2, 3), finish=True)
    key = bus_config.keys.out(R, "r5")
    await redis.delete(key)
    assert await writer.replay() == 0
    assert not await redis.exists(key)


async def test_finished_requests_leave_the_window_and_discarded_ones_at_once(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    clock = Clock()
    writer = ResultWriter(redis, bus_config, clock=clock)
    for rid in ("a", "b"):
        writer.open(rid, reader=R)
        await _write(writer, rid, range(2), finish=True)
    writer.open("c", reader=R)
    await _write(writer, "c", range(2))
    assert writer.retained == 8
    writer.discard("c")  # moved to another worker: its entries are that worker's to write
    assert writer.retained == 6
    clock.now += bus_config.replay_window_s + 1
    writer.open("d", reader=R)
    await _write(writer, "d", range(1))
    assert writer.retained == 1


async def test_window_zero_keeps_nothing(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    writer = ResultWriter(redis, dataclasses.replace(bus_config, replay_window_s=0))
    writer.open("r6", reader=R)
    await _write(writer, "r6", range(3))
    await redis.delete(bus_config.keys.out(R, "r6"))
    assert writer.retained == 0
    assert await writer.replay() == 0


@pytest.mark.parametrize("window", [-1.0, 121.0])
def test_replay_window_is_validated(window: float) -> None:
    with pytest.raises(ValueError, match="replay_window_s"):
        BusConfig(replay_window_s=window)


async def test_two_writers_of_one_stream_each_replay_their_own_part(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """P wrote the first token, D the rest (from first_seq 1); the run lost the whole stream.
    D replays first: what precedes its part is P's, not lost beyond D's window."""
    prefill, decode = ResultWriter(redis, bus_config), ResultWriter(redis, bus_config)
    prefill.open("r7", reader=R)
    await _write(prefill, "r7", range(1))
    prefill.forget("r7")  # handed off
    decode.open("r7", reader=R, first_seq=1)
    await _write(decode, "r7", range(1, 4), finish=True)
    key = bus_config.keys.out(R, "r7")
    await redis.delete(key)
    assert await decode.replay() == 4
    assert await prefill.replay() == 1
    reader = ResultReader(bus_config, redis, name="api-replay")
    await reader.start()
    try:
        results = await _collect(await reader.subscribe("r7"))
    finally:
        await reader.close()
    assert [r.seq for r in results] == [0, 1, 2, 3, 4]  # type: ignore[attr-defined]
    assert not any(isinstance(r, Failed) for r in results)
