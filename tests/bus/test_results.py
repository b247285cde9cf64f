"""Result streams: sequence stamping, the multiplexed reader, ordering and duplicates."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable

import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import Cancel, Failed, Finished, TokenDelta
from splitbus.bus.results import ClientLeft, ResultReader, ResultWriter, Sent, Subscription, read_sent

R = "api-test.0"
"""The reader shard of the streams a test writes without following them."""


async def _collect(sub: Subscription, timeout: float = 20.0) -> list[object]:
    async def drain() -> list[object]:
        return [r async for r in sub]

    return await asyncio.wait_for(drain(), timeout)


@pytest.fixture
async def reader(bus_config: BusConfig, redis: aioredis.Redis) -> ResultReader:
    reader = ResultReader(bus_config, redis, name="api-test", shards=2)
    await reader.start()
    yield reader
    await reader.close()


async def test_writer_stamps_sequence_and_sets_ttl(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    writer = ResultWriter(redis, bus_config)
    writer.open("r1", reader=R)
    writer.tokens("r1", [10])
    writer.tokens("r1", [11, 12], "ab")
    await writer.flush()
    key = bus_config.keys.out(R, "r1")
    assert 0 < await redis.ttl(key) <= bus_config.result_ttl_s
    writer.finish("r1", "length", prompt_tokens=3, completion_tokens=3)
    await writer.flush()
    entries = [codec.decode(f) for _, f in await redis.xrange(key)]
    assert [e.seq for e in entries] == [0, 1, 2]
    assert entries[1] == TokenDelta(seq=1, token_ids=[11, 12], text="ab")
    assert isinstance(entries[2], Finished)
    assert 0 < await redis.ttl(key) <= bus_config.finished_result_ttl_s


async def test_writer_rejects_tokens_for_unopened_request(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    with pytest.raises(KeyError, match="not opened"):
        ResultWriter(redis, bus_config).tokens("nobody", [1])


async def test_migrated_request_continues_its_sequence(
    redis: aioredis.Redis, bus_config: BusConfig, reader: ResultReader
) -> None:
    sub = await reader.subscribe("r1")
    first, second = ResultWriter(redis, bus_config), ResultWriter(redis, bus_config)
    first.open("r1", reader=reader.reader_of("r1"))
    for t in range(3):
        first.tokens("r1", [t])
    await first.flush()
    # The first worker dies after sending seq 0..2 (seq 2 possibly twice, by a retried XADD).
    await redis.xadd(sub.key, codec.encode(TokenDelta(seq=2, token_ids=[2])))
    second.open("r1", reader=reader.reader_of("r1"), first_seq=3)
    second.tokens("r1", [3])
    second.finish("r1", "length", 1, 4)
    await second.flush()
    got = await _collect(sub)
    assert [r.seq for r in got] == [0, 1, 2, 3, 4]
    assert [r.token_ids for r in got[:4]] == [[0], [1], [2], [3]]


async def test_thousand_streams_each_exact_and_in_order(
    redis: aioredis.Redis, bus_config: BusConfig, reader: ResultReader
) -> None:
    n_requests, n_steps = 1000, 12
    subs = [await reader.subscribe(f"req-{i}") for i in range(n_requests)]
    writer = ResultWriter(redis, bus_config)
    for i in range(n_requests):
        writer.open(f"req-{i}", reader=reader.reader_of(f"req-{i}"))
    for step in range(n_steps):
        for i in range(n_requests):
            writer.tokens(f"req-{i}", [i * 100 + step])
        await writer.flush()
    for i in range(n_requests):
        writer.finish(f"req-{i}", "length", 1, n_steps)
    await writer.flush()
    results = await asyncio.gather(*(_collect(s) for s in subs))
    for i, got in enumerate(results):
        assert [r.seq for r in got] == list(range(n_steps + 1))
        assert [r.token_ids[0] for r in got[:-1]] == [i * 100 + s for s in range(n_steps)]
    assert reader.active == 0


async def test_connections_do_not_grow_with_streams(
    redis: aioredis.Redis, bus_config: BusConfig, reader: ResultReader, redis_admin: sync_redis.Redis
) -> None:
    for i in range(1000):
        await reader.subscribe(f"c-{i}")
    await asyncio.sleep(0.3)  # let every shard run a read with the full set
    clients = redis_admin.client_list()  # CLIENT LIST: the admin's, not the splitbus user's
    readers = [c for c in clients if c["name"].startswith("api-test.")]
    assert len(readers) == reader.connections == 2  # one per shard, not one per stream
    assert all(c["cmd"] == "xread" for c in readers)


async def test_reader_holds_early_entries_and_drops_duplicates(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    sub = Subscription("r", "k")
    for seq in [2, 0, 0, 1, 2, 3]:
        sub.accept(TokenDelta(seq=seq, token_ids=[seq]))
    sub.accept(Finished(seq=4, finish_reason="stop", prompt_tokens=1, completion_tokens=4))
    sub.accept(TokenDelta(seq=5, token_ids=[5]))  # after the end: ignored
    got = await _collect(sub)
    assert [r.seq for r in got] == [0, 1, 2, 3, 4]


async def test_a_subscription_whose_client_left_stops_waiting_after_what_is_here() -> None:
    """``leave`` wakes a ``get`` that waits (the request's task, not a task of its own, waits on
    its results: generate.first_result); what arrived before still comes first."""
    sub = Subscription("r", "k")
    waiting = asyncio.ensure_future(sub.get())
    await asyncio.sleep(0)
    sub.leave()
    with pytest.raises(ClientLeft):
        await asyncio.wait_for(waiting, 5)
    ready = Subscription("r2", "k2")
    ready.accept(TokenDelta(seq=0, token_ids=[1]))
    ready.leave()
    assert (await ready.get()).seq == 0
    with pytest.raises(ClientLeft):
        await ready.get()


async def test_error_entry_ends_the_stream_whatever_its_seq(
    redis: aioredis.Redis, bus_config: BusConfig, reader: ResultReader
) -> None:
    sub = await reader.subscribe("r-err")
    writer = ResultWriter(redis, bus_config)
    writer.open("r-err", reader=reader.reader_of("r-err"))
    writer.tokens("r-err", [1])
    await writer.flush()
    # A scheduler that never saw the worker's tokens fails the request with seq 0.
    other = ResultWriter(redis, bus_config)
    other.fail("r-err", "no_worker", "no decode worker is alive", status=503, reader=reader.reader_of("r-err"))
    await other.flush()
    got = await _collect(sub)
    assert isinstance(got[-1], Failed) and got[-1].status == 503
    assert [type(r).__name__ for r in got] == ["TokenDelta", "Failed"]


async def test_undecodable_result_entry_is_skipped(
    redis: aioredis.Redis, bus_config: BusConfig, reader: ResultReader
) -> None:
    sub = await reader.subscribe("r-bad")
    key = sub.key
    await redis.xadd(key, {b"type": b"token", b"data": b"nonsense"})
    await redis.xadd(key, codec.encode(Finished(0, "stop", 1, 0)))
    got = await _collect(sub)
    assert [type(r).__name__ for r in got] == ["Finished"]


async def test_an_entry_that_is_not_a_result_is_skipped(
    redis: aioredis.Redis, bus_config: BusConfig, reader: ResultReader
) -> None:
    # A well-formed message of another type (anyone who can write the stream can put one there)
    # used to reach the subscription, which read its ``seq`` and took the shard's read down.
    sub = await reader.subscribe("r-foreign")
    key = sub.key
    await redis.xadd(key, codec.encode(Cancel("r-foreign")))
    await redis.xadd(key, codec.encode(TokenDelta(0, [5])))
    await redis.xadd(key, codec.encode(Finished(1, "stop", 1, 1)))
    got = await _collect(sub)
    assert [type(r).__name__ for r in got] == ["TokenDelta", "Finished"]


async def test_subscribing_wakes_a_blocked_reader(redis_server: object, redis: aioredis.Redis) -> None:
    # With a 4 s block, a new stream would wait for the in-flight XREAD to time out unless the
    # reader is woken; the 2 s bound below fails without the wake.
    config = BusConfig(redis_url=redis_server.url, prefix=f"wake{random.randrange(10**9)}", block_ms=4000)  # type: ignore[attr-defined]
    reader = ResultReader(config, redis, name="api-wake", shards=1)
    await reader.start()
    try:
        await asyncio.sleep(0.2)  # the shard is now blocked with no streams
        sub = await reader.subscribe("late")
        writer = ResultWriter(redis, config)
        writer.fail("late", "x", "y", reader=reader.reader_of("late"))
        await writer.flush()
        got = await _collect(sub, timeout=2.0)
        assert isinstance(got[0], Failed)
    finally:
        await reader.close()


async def test_a_failed_flush_keeps_its_entries(
    redis: aioredis.Redis, bus_config: BusConfig, reader: ResultReader
) -> None:
    sub = await reader.subscribe("r-keep")
    writer = ResultWriter(redis, bus_config)
    writer.open("r-keep", reader=reader.reader_of("r-keep"))
    writer.tokens("r-keep", [1])

    async def redis_is_away(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Redis is restarting")

    working = writer._writes._send
    writer._writes._send = redis_is_away  # type: ignore[assignment,method-assign]
    with pytest.raises(ConnectionError):
        await writer.flush()
    assert writer.pending == 1  # nothing was dropped
    writer._writes._send = working  # type: ignore[method-assign]
    writer.finish("r-keep", "length", 1, 1)
    await writer.flush()
    got = await _collect(sub)
    assert [r.seq for r in got] == [0, 1]
    assert 0 < await redis.ttl(sub.key) <= bus_config.finished_result_ttl_s


async def test_what_was_sent_is_read_back_in_seq_order(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    writer = ResultWriter(redis, bus_config)
    writer.open("r-sent", reader=R)
    writer.tokens("r-sent", [1, 2])
    writer.tokens("r-sent", [3])
    await writer.flush()
    await redis.xadd(bus_config.keys.out(R, "r-sent"), codec.encode(Cancel("r-sent")))  # not a result
    assert await read_sent(redis, bus_config, R, "r-sent") == Sent(next_seq=2, tokens=[1, 2, 3], ended=False)
    writer.finish("r-sent", "stop", 1, 3)
    await writer.flush()
    assert await read_sent(redis, bus_config, R, "r-sent") == Sent(next_seq=3, tokens=[1, 2, 3], ended=True)
    assert await read_sent(redis, bus_config, "api-other.0", "r-sent") == Sent()  # another reader's slot


async def test_a_step_is_one_script_per_reader_shard_in_one_round_trip(
    redis: aioredis.Redis, bus_config: BusConfig, reader: ResultReader
) -> None:
    # Two shards: a step over 40 requests goes out as two scripts, each over one shard's streams
    # (the suite's slot check fails any script whose keys span slots), in one pipeline.
    rids = [f"s-{i}" for i in range(40)]
    subs = [await reader.subscribe(rid) for rid in rids]
    assert {reader.reader_of(rid) for rid in rids} == {"api-test.0", "api-test.1"}
    writer, pipelines = ResultWriter(redis, bus_config), []
    execute = type(redis.pipeline()).execute

    async def counted(pipe: object, *args: object, **kwargs: object) -> object:
        names = [command[0][0] for command in pipe.command_stack]  # type: ignore[attr-defined]
        if "EVALSHA" in names:  # not the reader's wake-ups, which share the client
            pipelines.append(len(names))
        return await execute(pipe, *args, **kwargs)  # type: ignore[arg-type]

    for rid in rids:
        writer.open(rid, reader=reader.reader_of(rid))
        writer.tokens(rid, [7])
        writer.finish(rid, "length", 1, 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(redis.pipeline()), "execute", counted)
        await writer.flush()
    assert pipelines == [2] and writer.scripts == 2
    for sub, got in zip(subs, await asyncio.gather(*(_collect(s) for s in subs)), strict=True):
        assert [type(r).__name__ for r in got] == ["TokenDelta", "Finished"], sub.key
        assert sub.key.startswith(f"{bus_config.prefix}:out:{{{reader.reader_of(sub.request_id)}}}:")


async def test_a_script_redis_lost_is_loaded_again(
    redis: aioredis.Redis, bus_config: BusConfig, redis_admin: sync_redis.Redis
) -> None:
    writer = ResultWriter(redis, bus_config)
    writer.open("r-lost", reader=R)
    writer.tokens("r-lost", [1])
    await writer.flush()
    redis_admin.script_flush()  # what a restarted Redis without its AOF'd scripts looks like
    writer.tokens("r-lost", [2])
    writer.open("r-other", reader="api-test.1")
    writer.tokens("r-other", [3])
    await writer.flush()
    assert writer.pending == 0
    redis_admin.script_flush()
    writer.tokens("r-lost", [4])  # one reader: the script goes alone, not in a pipeline
    await writer.flush()
    assert await read_sent(redis, bus_config, R, "r-lost") == Sent(next_seq=3, tokens=[1, 2, 4])
    assert await read_sent(redis, bus_config, "api-test.1", "r-other") == Sent(next_seq=1, tokens=[3])


def test_a_reader_name_must_fit_a_hash_tag(bus_config: BusConfig) -> None:
    with pytest.raises(ValueError, match="hash tag"):
        ResultReader(bus_config, aioredis.Redis(), name="api{1}")


async def _gone(redis: aioredis.Redis, key: str, within_s: float = 10.0) -> bool:
    """Whether ``key`` is deleted within ``within_s`` (a bound on the wait, not a timing check)."""
    for _ in range(int(within_s / 0.05)):
        if not await redis.exists(key):
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("grace_s", [0.0, 0.2])
async def test_a_stream_read_to_its_end_goes_after_the_grace(
    redis: aioredis.Redis, bus_config: BusConfig, grace_s: float
) -> None:
    """Once the reader has the final entry nothing needs the stream: it is deleted after the
    grace (at once for 0), not kept finished_result_ttl_s; the request's hand-off id goes too."""
    config = dataclasses.replace(bus_config, result_grace_s=grace_s)
    reader = ResultReader(config, redis, name="api-grace")
    await reader.start()
    try:
        sub = await reader.subscribe("r-done")
        await redis.set(config.keys.current("r-done"), "a-handoff", ex=600)  # as a dispatch leaves it
        writer = ResultWriter(redis, config)
        writer.open("r-done", reader="api-grace.0")
        writer.tokens("r-done", [1])
        writer.finish("r-done", "length", 1, 1)
        await writer.flush()
        assert [r.seq for r in await _collect(sub)] == [0, 1]
        assert await _gone(redis, config.keys.out("api-grace.0", "r-done"))
        assert await _gone(redis, config.keys.current("r-done"))
    finally:
        await reader.close()


async def test_a_stream_nobody_read_to_its_end_still_expires_after_its_final_entry(
    redis: aioredis.Redis, bus_config: BusConfig, reader: ResultReader
) -> None:
    """A client that went away (unsubscribed before the end), or no reader at all: the stream
    keeps the backstop TTL from its final entry, and the reader's grace does not apply."""
    await redis.set(bus_config.keys.current("r-left"), "a-handoff", ex=600)
    left = await reader.subscribe("r-left")
    reader.unsubscribe(left)
    writer = ResultWriter(redis, bus_config)
    for request_id in ("r-left", "r-unread"):
        writer.open(request_id, reader=reader.reader_of(request_id))
        writer.tokens(request_id, [1])
        writer.finish(request_id, "length", 1, 1)
    await writer.flush()
    for request_id in ("r-left", "r-unread"):
        ttl = await redis.ttl(bus_config.keys.out(reader.reader_of(request_id), request_id))
        assert bus_config.result_grace_s < ttl <= bus_config.finished_result_ttl_s
    assert await redis.exists(bus_config.keys.current("r-left"))  # kept to the deadline: it may still move


async def test_a_stream_written_again_after_it_was_deleted_expires(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """A worker still writing a run whose stream the API retired (a run nobody follows any more)
    recreates the stream: it gets a TTL, as a finished one does, not none for ever. A stream that
    exists keeps the TTL it has (no EXPIRE per entry)."""
    writer = ResultWriter(redis, bus_config)
    writer.open("r", reader=R)
    writer.tokens("r", [1])
    await writer.flush()
    assert await redis.ttl(bus_config.keys.out(R, "r")) > bus_config.finished_result_ttl_s  # the first entry's
    await redis.delete(bus_config.keys.out(R, "r"))  # retired by the reader
    writer.tokens("r", [2])
    await writer.flush()
    assert 0 < await redis.ttl(bus_config.keys.out(R, "r")) <= bus_config.finished_result_ttl_s
    await redis.expire(bus_config.keys.out(R, "r"), 1000)
    writer.tokens("r", [3])
    await writer.flush()
    assert 120 < await redis.ttl(bus_config.keys.out(R, "r")) <= 1000


def test_the_grace_is_at_most_the_backstop() -> None:
    with pytest.raises(ValueError, match="result_grace_s"):
        BusConfig(result_grace_s=-1)
    with pytest.raises(ValueError, match="result_grace_s"):
        BusConfig(result_grace_s=121, finished_result_ttl_s=120)


async def test_a_small_reply_is_handed_over_before_the_shard_reads_again(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """The handler a token wakes runs before the shard's next XREAD is built and sent (one loop
    turn: HAND_OVER_STREAMS); the shard's xreads still counts the read that delivered it."""
    reader = ResultReader(bus_config, redis, name="api-hand", shards=1)
    await reader.start()
    try:
        sub = await reader.subscribe("r-hand")
        (shard,) = reader._shards
        writer = ResultWriter(redis, bus_config)
        writer.open("r-hand", reader=reader.reader_of("r-hand"))
        writer.tokens("r-hand", [10])

        async def handler() -> int:
            await sub.get()
            return shard.xreads  # as the handler resumes

        waiting = asyncio.ensure_future(handler())
        await asyncio.sleep(0.1)  # the shard is blocked on its read with the stream in it
        reads = shard.xreads
        await writer.flush()
        assert await asyncio.wait_for(waiting, 5) == reads  # resumed before the next XREAD was issued
        assert await asyncio.wait_for(_until(lambda: shard.xreads == reads + 1), 5)  # then it reads again
    finally:
        await reader.close()


async def _until(condition: Callable[[], bool]) -> bool:
    while not condition():
        await asyncio.sleep(0.01)
    return True
