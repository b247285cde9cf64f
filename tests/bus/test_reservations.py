"""The ``sb:kv`` reservation protocol against a real Redis: reserve, read (validated), drop."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.records import Reservation
from splitbus.bus.reservations import TTL_S, Reservations


def made(entry: str = "7-0", handoff: str = "h1", secret: str = "s" * 64) -> Reservation:
    return Reservation(
        decode_worker="d1",
        endpoint="127.0.0.1:9",
        blocks=12,
        prefill_worker="p1",
        task_entry=entry,
        secret=secret,
        handoff=handoff,
    )


async def test_a_reservation_reads_back_as_it_was_written_with_its_ttl(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    reservations = Reservations(redis, bus_config.keys)
    assert await reservations.read("r1") is None
    assert await reservations.reserve("r1", made())
    assert await reservations.read("r1") == made()
    assert 0 < await redis.ttl(bus_config.keys.kv("r1")) <= TTL_S


@pytest.mark.parametrize(("current", "written"), [(None, True), ("h1", True), ("h-newer", False)])
async def test_only_the_current_dispatch_reserves(
    redis: aioredis.Redis, bus_config: BusConfig, current: str | None, written: bool
) -> None:
    reservations = Reservations(redis, bus_config.keys)
    if current is not None:
        await redis.set(bus_config.keys.current("r2"), current)
    assert await reservations.reserve("r2", made()) is written
    assert (await reservations.read("r2") is not None) is written


async def test_a_drop_deletes_only_the_reservation_its_task_made(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    reservations = Reservations(redis, bus_config.keys)
    await reservations.reserve("r3", made(entry="2-0"))
    await reservations.drop("r3", "1-0")  # an older task of the request: the new one's stays
    assert await reservations.read("r3") == made(entry="2-0")
    await reservations.drop("r3", "2-0")
    assert await reservations.read("r3") is None


async def test_a_read_queued_in_a_pipeline_parses_as_a_plain_read(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    reservations = Reservations(redis, bus_config.keys)
    await reservations.reserve("r4", made())
    pipe = redis.pipeline(transaction=False)
    reservations.queue_read(pipe, "r4")
    reservations.queue_read(pipe, "nothing")
    found, none = await pipe.execute()
    assert (reservations.parse("r4", found), reservations.parse("nothing", none)) == (made(), None)


@pytest.mark.parametrize(
    "forged",
    [
        {"blocks": "-1"},
        {"blocks": "1e9"},
        {"blocks": "9" * 40},
        {"decode_worker": ""},
        {"task_entry": "x" * 300},
        {"secret": b"\xff\xfe"},
        {"endpoint": "e" * 100_000},
        {"handoff": "h" * 65},
    ],
)
async def test_a_forged_or_partial_reservation_reads_as_none(
    redis: aioredis.Redis, bus_config: BusConfig, forged: dict[str, str | bytes]
) -> None:
    # Anyone with Redis access can write the hash: what a reader gets is a valid reservation or none.
    reservations = Reservations(redis, bus_config.keys)
    await reservations.reserve("r5", made())
    await redis.hset(bus_config.keys.kv("r5"), mapping=forged)
    assert await reservations.read("r5") is None
    partial = {k: v for k, v in made().to_hash().items() if k != "secret"}
    await redis.delete(bus_config.keys.kv("r5"))
    await redis.hset(bus_config.keys.kv("r5"), mapping=partial)
    assert await reservations.read("r5") is None


async def test_a_reservation_from_before_hand_off_ids_reads_with_no_handoff(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    reservations = Reservations(redis, bus_config.keys)
    older = {k: v for k, v in made().to_hash().items() if k != "handoff"}
    await redis.hset(bus_config.keys.kv("r6"), mapping=older)
    assert await reservations.read("r6") == made(handoff="")


def test_a_reservation_is_validated_when_made_and_keeps_its_secret_out_of_its_repr() -> None:
    with pytest.raises(ValueError, match="blocks"):
        Reservation("d1", "", -1, "p1", "1-0", "s")
    with pytest.raises(ValueError, match="handoff"):
        Reservation("d1", "", 0, "p1", "1-0", "s", handoff="h" * 65)
    assert "the-secret" not in repr(made(secret="the-secret"))


def test_made_for_is_the_pair_and_dispatch() -> None:
    reservation = made()
    assert reservation.made_for("d1", "p1", "h1")
    assert not reservation.made_for("d1", "p1", "h0")
    assert not reservation.made_for("d1", "p0", "h1")
    assert not reservation.made_for("d2", "p1", "h1")
