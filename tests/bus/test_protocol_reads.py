"""Small reads other parts make of the bus's keys, against a real Redis: each is parsed and
bounded in its bus module, and a pipelined read parses like a plain one."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.dispatch import MAX_HANDOFF_BYTES, CurrentDispatch
from splitbus.bus.registry import MAX_ENDPOINT_BYTES, Registry, WorkerRecord


async def test_the_current_dispatch_reads_back_plain_and_pipelined(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    current = CurrentDispatch(redis, bus_config.keys)
    assert await current.read("r1") is None
    await redis.set(bus_config.keys.current("r1"), "h1")
    pipe = redis.pipeline(transaction=False)
    current.queue_read(pipe, "r1")
    current.queue_read(pipe, "none")
    assert [current.parse(reply) for reply in await pipe.execute()] == [b"h1", None]
    assert await current.read("r1") == b"h1"


async def test_a_forged_current_id_is_cut_but_still_names_another_dispatch(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    await redis.set(bus_config.keys.current("r1"), b"h" * 100_000)
    read = await CurrentDispatch(redis, bus_config.keys).read("r1")
    assert read is not None and len(read) == MAX_HANDOFF_BYTES + 1
    assert read != ("h" * 64).encode()  # the longest id a task can carry


@pytest.mark.parametrize(("reply", "parsed"), [("h1", b"h1"), (None, None)])
def test_a_decoding_clients_current_id_is_bytes_too(reply: str | None, parsed: bytes | None) -> None:
    assert CurrentDispatch.parse(reply) == parsed


def test_a_current_id_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(TypeError):
        CurrentDispatch.parse(12)


async def test_a_worker_is_dead_once_a_reaper_marked_it(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(WorkerRecord(worker_id="d1", role="decode", model="m", engine="sim"), lease_ms=5000)
    assert not await registry.is_dead("d1")
    await registry.mark_dead("d1")
    pipe = redis.pipeline(transaction=False)
    registry.queue_dead(pipe, "d1")
    registry.queue_dead(pipe, "never")
    assert [registry.dead(reply) for reply in await pipe.execute()] == [True, False]
    assert await registry.is_dead("d1")


async def test_a_registered_endpoint_and_lease_read_in_one_pipeline(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry = Registry(redis, bus_config)
    record = WorkerRecord(worker_id="d1", role="decode", model="m", engine="sim", transfer_endpoint="127.0.0.1:9")
    await registry.register(record, lease_ms=5000)
    pipe = redis.pipeline(transaction=False)
    registry.queue_endpoint_and_lease(pipe, "d1")
    registry.queue_endpoint_and_lease(pipe, "gone")
    endpoint, alive, no_endpoint, not_alive = await pipe.execute()
    assert (registry.endpoint(endpoint), bool(alive)) == ("127.0.0.1:9", True)
    assert (registry.endpoint(no_endpoint), bool(not_alive)) == ("", False)


@pytest.mark.parametrize("forged", [b"e" * (MAX_ENDPOINT_BYTES + 1), 7, [b"127.0.0.1:9"]])
def test_an_endpoint_no_reservation_could_name_reads_as_none(forged: object) -> None:
    assert Registry.endpoint(forged) == ""


def test_a_non_utf8_endpoint_reads_with_replacement_characters() -> None:
    assert Registry.endpoint(b"127.0.0.1:\xff") == "127.0.0.1:\ufffd"
