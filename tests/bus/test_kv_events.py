"""KV event messages (validation, bounds) and the publisher/reader round trip on a real Redis."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from splitbus.bus.blocks import block_hashes, root_of
from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.replies import for_xadd
from splitbus.bus.kv_events import KvEventPublisher, KvEventReader, Refused, split_batches
from splitbus.bus.messages.kv_events import (
    MAX_BLOCK_SIZE,
    MAX_SNAPSHOT_HASHES,
    MIN_BATCH_HASHES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvSnapshot,
    batch_bytes,
    block_hash,
    snapshot_bytes,
)


def _batch(**data: Any) -> dict[bytes, bytes]:
    import orjson

    base: dict[str, Any] = {"worker": "w0", "instance": "i1", "event_id": 1, "events": []}
    return {b"type": b"kv_events", b"data": orjson.dumps(base | data)}


def test_a_batch_round_trips_through_the_codec() -> None:
    batch = KvEventBatch("w0", "i1", 3, [BlockStored(["a1", "b2"], "ff", 16), BlockRemoved(["c3"]), AllBlocksCleared()])
    assert codec.decode(codec.encode(batch)) == batch


@pytest.mark.parametrize(
    "data",
    [
        {"event_id": 0},
        {"event_id": True},
        {"event_id": 2**60},
        {"worker": ""},
        {"dp_rank": -2},
        {"events": "stored"},
        {"events": [{"kind": "moved", "block_hashes": []}]},
        {"events": [{"kind": "stored", "block_hashes": ["XYZ"]}]},
        {"events": [{"kind": "stored", "block_hashes": ["a" * 65]}]},
        {"events": [{"kind": "stored", "block_hashes": [12]}]},
        {"events": [{"kind": "stored", "block_hashes": ["ab"], "block_size": 0}]},
        {"events": [{"kind": "stored", "block_hashes": ["ab"], "parent_block_hash": "g"}]},
        {"events": [{"kind": "removed"}]},
        {"events": [{"kind": "cleared"}] * 4097},
        {"events": [{"kind": "removed", "block_hashes": ["ab"] * 2**16}] * 3},
    ],
)
def test_a_bad_batch_is_refused(data: dict[str, Any]) -> None:
    with pytest.raises(DecodeError):
        codec.decode(_batch(**data))


def test_splitbus_own_128_bit_hashes_round_trip_through_the_codec() -> None:
    """JSON carries them as hex strings (an int over 64 bits is no JSON number orjson writes)."""
    hashes = [block_hash(h) for h in block_hashes(list(range(160)), 16, parent=root_of("ab" * 16))]
    batch = KvEventBatch("w0", "i1", 1, [BlockStored(hashes[1:], hashes[0], 16), BlockRemoved(hashes[:1])])
    assert codec.decode(codec.encode(batch)) == batch and {len(h) for h in hashes} == {32}
    snapshot = KvSnapshot("w0", "i1", 1, "1-0", hashes)
    assert codec.decode(codec.encode(snapshot)) == snapshot


def test_the_largest_snapshot_of_128_bit_hashes_fits_the_codec() -> None:
    """Measured on a thousand hashes, scaled to MAX_SNAPSHOT_HASHES: a full snapshot a worker may
    write is one a scheduler decodes (2**22 hashes, the bound for 64-bit ones, would not be)."""
    hashes = [block_hash(h) for h in block_hashes(list(range(16_000)), 16)]
    size = len(codec.encode(KvSnapshot("w0", "i1", 1, "1-0", hashes))[b"data"])
    assert size / len(hashes) * MAX_SNAPSHOT_HASHES < codec.MAX_DATA_BYTES
    assert size / len(hashes) * 2**22 > codec.MAX_DATA_BYTES


def test_a_snapshot_is_validated() -> None:
    assert KvSnapshot("w0", "i1", 0, "0").block_hashes == []
    for bad in ({"stream_id": "x"}, {"event_id": -1}, {"block_hashes": ["A"]}):
        with pytest.raises(ValueError):
            KvSnapshot(**({"worker": "w0", "instance": "i1", "event_id": 1, "stream_id": "1-0"} | bad))


def test_block_hash_takes_ints_bytes_and_hex() -> None:
    assert block_hash(255) == "0" * 30 + "ff" and block_hash(2**128) == "1" + "0" * 32  # at least 32 digits
    assert block_hash(b"\x00\x01") == "0001"
    assert block_hash("abc") == "abc"
    for bad in (-1, 2**256, b"", b"x" * 33, "ABC", "", True):
        with pytest.raises(ValueError):
            block_hash(bad)  # type: ignore[arg-type]  # True: a bool is refused too


def test_a_big_step_is_split_into_chained_batches() -> None:
    hashes = [format(i, "x") for i in range(1, 11)]
    batches = split_batches([BlockStored(hashes, "", 16), BlockRemoved(["aa"])], max_hashes=4)
    assert [len(b) for b in batches] == [1, 1, 2]
    pieces = [e for b in batches for e in b]
    assert [e.parent_block_hash for e in pieces[:3] if isinstance(e, BlockStored)] == ["", "4", "8"]
    assert split_batches([BlockStored(["a"]), BlockRemoved(["b"])]) == [[BlockStored(["a"]), BlockRemoved(["b"])]]
    assert split_batches([]) == []


async def test_published_steps_are_read_in_order_with_one_entry_per_step(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    publisher = KvEventPublisher(redis, bus_config, "w0", dp_rank=2)
    await publisher.start()
    await publisher.publish([BlockStored(["a1", "a2"], "", 16)])
    await publisher.publish([])  # nothing changed: nothing sent
    await publisher.publish([BlockRemoved(["a2"]), BlockStored(["b1"], "a1", 16)])
    assert await redis.xlen(bus_config.keys.kv_events("w0")) == 3
    await redis.xadd(bus_config.keys.kv_events("w1"), for_xadd(_batch(worker="w0")))  # names another worker
    read = await KvEventReader(redis, bus_config).read({"w0": "0", "w1": "0"})
    ours = [r.batch for r in read if r.worker == "w0"]
    assert [b.event_id for b in ours if b] == [1, 2, 3]
    assert all(b and b.dp_rank == 2 and b.instance == publisher.instance for b in ours)
    assert [(r.worker, r.batch) for r in read if r.worker == "w1"] == [("w1", None)]
    assert publisher.cached == {"a1", "b1"}


async def test_the_snapshot_is_written_when_asked_and_names_its_entry(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    now = [0.0]
    publisher = KvEventPublisher(redis, bus_config, "w0", snapshot_every_s=1000, clock=lambda: now[0])
    reader = KvEventReader(redis, bus_config)
    assert await reader.snapshots(["w0"]) == {"w0": None}
    await publisher.start()
    await publisher.publish([BlockStored(["a1"], "", 16)])
    now[0] = 1.0
    assert not await publisher.maybe_snapshot()  # not due, not asked
    await reader.request_snapshot("w0")
    now[0] = 2.0
    assert await publisher.maybe_snapshot()
    snapshot = (await reader.snapshots(["w0"]))["w0"]
    assert snapshot is not None and snapshot.event_id == 2 and snapshot.block_hashes == ["a1"]
    (last,) = await redis.xrevrange(bus_config.keys.kv_events("w0"), count=1)
    assert snapshot.stream_id == last[0].decode()
    assert await redis.hget(bus_config.keys.kv_snapshot("w0"), "requested") is None
    assert 0 < await redis.ttl(bus_config.keys.kv_snapshot("w0")) <= 3600


async def test_start_again_after_an_error_announces_the_fresh_cache_once(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    publisher = KvEventPublisher(redis, bus_config, "w0")
    await publisher.start()
    await publisher.start()  # as a start-up step retried after its snapshot failed
    assert await redis.xlen(bus_config.keys.kv_events("w0")) == 1 and publisher.event_id == 1


async def test_a_small_workers_honest_batches_fit_the_bound_a_reader_holds_it_to(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """A publisher of 8 blocks splits a step at ``batch_hashes(8)``: its largest batches (one
    64-digit hash per event, a 64-digit parent, the largest block size) and its snapshot are
    within ``batch_bytes(8)`` and ``snapshot_bytes(8)``; a reader given those bounds decodes them
    all, and refuses a batch of 2**17 hashes undecoded."""
    publisher = KvEventPublisher(redis, bus_config, "w0", total_kv_blocks=8)
    await publisher.start()
    hashes = [format(i, "064x") for i in range(3 * MIN_BATCH_HASHES)]
    step = [BlockStored([h], "f" * 64, MAX_BLOCK_SIZE) for h in hashes] + [BlockRemoved(hashes[8:])]
    await publisher.publish(step)
    await publisher.write_snapshot()
    entries = await redis.xrange(bus_config.keys.kv_events("w0"))  # the start, 3 + 3 of 1024 hashes at most
    assert len(entries) == 7 and max(len(fields[b"data"]) for _, fields in entries) <= batch_bytes(8)
    snapshot_size = len(await redis.hget(bus_config.keys.kv_snapshot("w0"), "data") or b"")
    assert snapshot_size <= snapshot_bytes(8)
    huge = KvEventBatch("w0", publisher.instance, 8, [BlockStored(hashes * 42)])
    await redis.xadd(bus_config.keys.kv_events("w0"), for_xadd(codec.encode(huge)))
    reader = KvEventReader(redis, bus_config)
    read = await reader.read({"w0": "0"}, max_bytes={"w0": batch_bytes(8)})
    assert [r.batch.event_id if r.batch else r.oversized for r in read] == [1, 2, 3, 4, 5, 6, 7, True]
    snapshot = (await reader.snapshots(["w0"], {"w0": snapshot_bytes(8)}))["w0"]
    assert isinstance(snapshot, KvSnapshot) and len(snapshot.block_hashes) == 8
    assert await reader.snapshots(["w0"], {"w0": snapshot_size - 1}) == {"w0": Refused.OVERSIZED}
