"""The ordered writer (``splitbus.bus.core.ordered``): one script run per slot group and chunk, in
order; what failed is written again first; a lost script is loaded again."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import EncodableT

from splitbus.bus.core.ordered import OrderedWriter
from splitbus.bus.core.scripts import LuaScript

# A test script, not declared: it is no part of the bus.
_APPEND = LuaScript(
    name="test_append",
    module=__name__,
    keys=(),
    repeated=("<stream>",),
    argv="per key: the value",
    returns="the number of entries written",
    source="for i, key in ipairs(KEYS) do redis.call('XADD', key, '*', 'v', ARGV[i]) end return #KEYS",
)


@dataclass(frozen=True)
class _Item:
    key: str
    value: str


def _args_of(items: list[_Item]) -> tuple[list[str], list[EncodableT]]:
    return [item.key for item in items], [item.value for item in items]


def _writer(redis: aioredis.Redis, chunk: int = 1000) -> tuple[OrderedWriter[_Item], list[list[_Item]]]:
    return OrderedWriter(redis, _APPEND, chunk), []


def _add(writer: OrderedWriter[_Item], item: _Item) -> None:
    writer.add(item.key.split("}")[0], item.value, item)  # slot: the hash tag; owner: the value


async def _flush(writer: OrderedWriter[_Item], rounds: list[list[_Item]]) -> None:
    """What an owner's flush does (``ResultWriter.flush``): rounds until nothing is buffered, the
    script loaded again once if Redis lost it; each round's written items go to ``rounds``."""
    reloaded = False
    while writer.pending:
        done = await writer.write([_args_of(run) for run in writer.runs()])
        rounds.append(done.written)
        if done.lost_script and not reloaded:
            await writer.reload()
            reloaded = True
        elif done.errors:
            raise done.errors[0]


@pytest.fixture(autouse=True)
async def loaded(redis: aioredis.Redis) -> None:
    """The server has the script (as it has once any writer ran it), so runs are counted as sent."""
    await redis.script_load(_APPEND.source)


async def _values(redis: aioredis.Redis, key: str) -> list[str]:
    return [fields[b"v"].decode() for _, fields in await redis.xrange(key)]


async def test_one_run_per_slot_and_chunk_each_key_in_order(redis: aioredis.Redis) -> None:
    a, b = f"t:{{{uuid.uuid4().hex}}}:a", f"t:{{{uuid.uuid4().hex}}}:b"
    writer, rounds = _writer(redis, chunk=2)
    items = [_Item(a, "a1"), _Item(b, "b1"), _Item(a, "a2"), _Item(a, "a3"), _Item(b, "b2")]
    for item in items:
        _add(writer, item)
    assert writer.pending == 5
    await _flush(writer, rounds)
    assert writer.pending == 0
    assert writer.scripts == 3  # a: two chunks, b: one
    assert rounds == [items]
    assert await _values(redis, a) == ["a1", "a2", "a3"]
    assert await _values(redis, b) == ["b1", "b2"]


async def test_what_failed_is_written_first_on_the_next_flush(redis: aioredis.Redis) -> None:
    a, b = f"t:{{{uuid.uuid4().hex}}}:a", f"t:{{{uuid.uuid4().hex}}}:b"
    await redis.set(b, "not a stream")  # its run fails (WRONGTYPE); the other's is written
    writer, rounds = _writer(redis)
    _add(writer, _Item(a, "a1"))
    _add(writer, _Item(b, "b1"))
    with pytest.raises(ResponseError):
        await _flush(writer, rounds)
    assert rounds == [[_Item(a, "a1")]] and writer.pending == 1
    _add(writer, _Item(b, "b2"))
    writer.drop("nothing buffered has this value")
    assert writer.holds("b1")
    await redis.delete(b)
    await _flush(writer, rounds)
    assert await _values(redis, b) == ["b1", "b2"]
    assert await _values(redis, a) == ["a1"]


async def test_dropped_items_are_not_written_and_first_ones_go_ahead(redis: aioredis.Redis) -> None:
    a = f"t:{{{uuid.uuid4().hex}}}:a"
    writer, rounds = _writer(redis)
    for value in ("1", "2", "3"):
        _add(writer, _Item(a, value))
    writer.drop("2")
    writer.add_first([(a.split("}")[0], "0", _Item(a, "0"))])
    await _flush(writer, rounds)
    assert await _values(redis, a) == ["0", "1", "3"]


async def test_a_script_redis_lost_is_loaded_again(redis: aioredis.Redis, redis_admin: sync_redis.Redis) -> None:
    a = f"t:{{{uuid.uuid4().hex}}}:a"
    writer, rounds = _writer(redis)
    redis_admin.script_flush()  # as after a restart that lost it
    _add(writer, _Item(a, "1"))
    await _flush(writer, rounds)
    assert writer.scripts == 2  # NOSCRIPT, loaded, sent again
    assert await _values(redis, a) == ["1"]
