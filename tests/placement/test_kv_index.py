"""The scheduler's KV index: events applied in order, gap and trimmed stream -> resync from the
snapshot, a dead worker's entries dropped, overlap counting, the silent-worker alarm, and no
worker holding more blocks than its record's total."""

from __future__ import annotations

import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.replies import for_xadd
from splitbus.bus.kv_events import KvEventPublisher, KvEventReader
from splitbus.bus.messages.kv_events import (
    MAX_BATCH_HASHES,
    MAX_SNAPSHOT_HASHES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvSnapshot,
)
from splitbus.bus.records import WorkerLoad
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.placement.kv_index import UNREPORTED_BLOCKS, KvIndex, KvIndexFeeder, capacity_limit
from splitbus.scheduler.config import SchedulerConfig
from splitbus.scheduler.scheduler import Scheduler


def _stored(event_id: int, *hashes: str, instance: str = "i1") -> KvEventBatch:
    return KvEventBatch("w0", instance, event_id, [BlockStored(list(hashes))])


def test_batches_in_order_are_applied_and_overlap_counts_leading_blocks() -> None:
    index = KvIndex()
    assert index.apply("w0", "1-0", KvEventBatch("w0", "i1", 1, [AllBlocksCleared()])) == "applied"
    assert index.apply("w0", "2-0", _stored(2, "a", "b", "c")) == "applied"
    assert index.apply("w1", "1-0", KvEventBatch("w1", "j", 1, [BlockStored(["a"])])) == "applied"
    assert index.overlap("w0", ["a", "b", "e", "c"]) == 2
    assert index.overlap("w1", ["a", "b"]) == 1 and index.overlap("nobody", ["a"]) == 0
    assert index.overlaps(["a", "b", "c"]) == {"w0": 3, "w1": 1}
    assert index.overlaps(["9"]) == {} and index.overlaps([]) == {}
    assert index.apply("w0", "2-0", _stored(2, "f")) == "stale"
    assert index.apply("w0", "3-0", KvEventBatch("w0", "i1", 3, [BlockRemoved(["b"])])) == "applied"
    assert index.overlaps(["a", "b", "c"]) == {"w0": 1, "w1": 1}
    assert index.cursor("w0") == "3-0"


def test_a_gap_waits_for_the_snapshot_which_replaces_the_blocks() -> None:
    index = KvIndex()
    index.apply("w0", "1-0", _stored(1, "a"))
    assert index.apply("w0", "3-0", _stored(3, "c")) == "gap"
    assert index.needs_resync("w0") and index.overlap("w0", ["a"]) == 1  # kept meanwhile
    assert index.apply("w0", "4-0", _stored(4, "d")) == "stale"
    assert index.load("w0", KvSnapshot("w0", "i1", 3, "3-0", ["a", "b", "c"])) == "resync"
    assert index.cursor("w0") == "3-0" and not index.needs_resync("w0")
    assert index.apply("w0", "4-0", _stored(4, "d")) == "applied"
    assert index.overlap("w0", ["a", "b", "c", "d"]) == 4


def test_a_stream_trimmed_past_the_snapshot_asks_for_a_fresh_one() -> None:
    index = KvIndex()
    old = KvSnapshot("w0", "i1", 2, "2-0", ["a"])
    index.load("w0", old)
    assert index.apply("w0", "9-0", _stored(9, "9")) == "gap"  # batches 3..8 were trimmed
    assert not index.usable("w0", old)
    assert index.usable("w0", KvSnapshot("w0", "i1", 9, "9-0", ["a", "9"]))


def test_a_restarted_worker_starts_over_and_a_dead_one_goes() -> None:
    index = KvIndex()
    index.apply("w0", "1-0", _stored(1, "a", "b"))
    assert index.apply("w0", "5-0", KvEventBatch("w0", "i2", 1, [AllBlocksCleared()])) == "applied"
    assert index.overlap("w0", ["a"]) == 0
    index.apply("w0", "6-0", _stored(2, "c", instance="i2"))
    index.apply("w1", "1-0", KvEventBatch("w1", "j", 1, [BlockStored(["c"])]))
    assert index.retain({"w1"}) == ["w0"]
    assert index.overlaps(["c"]) == {"w1": 1} and index.workers() == ["w1"]


def test_a_worker_routed_to_without_events_is_silent() -> None:
    now = [0.0]
    index = KvIndex(clock=lambda: now[0])
    index.apply("w0", "1-0", _stored(1, "a"))
    now[0] = 1.0
    assert index.decided("w0", ["a", "b"]) == 1
    now[0] = 5.0
    assert index.silent(after_s=10) == []
    now[0] = 12.0
    assert index.silent(after_s=10) == ["w0"]
    index.apply("w0", "2-0", _stored(2, "b"))
    assert index.silent(after_s=10) == []


async def test_the_feeder_follows_the_bus_and_resyncs_after_a_trim(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    publisher = KvEventPublisher(redis, bus_config, "w0", maxlen=1)
    await publisher.start()
    for i in range(1, 40):
        await publisher.publish([BlockStored([format(i, "x")], format(i - 1, "x") if i > 1 else "")])
    index, now = KvIndex(), [0.0]
    feeder = KvIndexFeeder(index, KvEventReader(redis, bus_config), clock=lambda: now[0])
    await feeder.poll(["w0"])  # its snapshot is of event 1: the batches after it were trimmed
    assert index.needs_resync("w0")
    await feeder.poll(["w0"])  # asked for a fresh one
    assert await publisher.maybe_snapshot()
    await feeder.poll(["w0"])
    assert index.needs_resync("w0")  # an asked worker is looked at again only half a second later
    now[0] += 0.5
    await feeder.poll(["w0"])
    assert not index.needs_resync("w0")
    assert index.overlap("w0", [format(i, "x") for i in range(1, 40)]) == 39
    await publisher.publish([BlockRemoved(["1"])])
    await feeder.poll(["w0"])
    assert index.overlap("w0", ["1"]) == 0 and index.overlap("w0", ["2"]) == 1
    await feeder.poll([])  # the lease went
    assert index.workers() == [] and index.overlaps(["2"]) == {}


def test_overlap_buckets_are_bounded() -> None:
    from splitbus.placement.metrics import overlap_bucket

    assert [overlap_bucket(n) for n in (0, 1, 7, 8, 63, 64, 10**6)] == ["0", "1-7", "1-7", "8-63", "8-63", "64+", "64+"]


def test_a_prediction_counts_until_events_confirm_it_or_it_lapses() -> None:
    now = [0.0]
    index = KvIndex(clock=lambda: now[0])
    index.apply("w0", "1-0", _stored(1, "a"))
    index.predict("w0", ["a", "b", "c"], for_s=5)
    index.predict("w1", ["a", "b"], for_s=5)
    assert index.overlaps(["a", "b", "c"]) == {"w0": 3, "w1": 2}
    index.apply("w0", "2-0", _stored(2, "b"))  # confirmed: stays after the prediction's time
    index.apply("w0", "3-0", KvEventBatch("w0", "i1", 3, [BlockRemoved(["c"])]))  # still predicted
    assert index.overlap("w0", ["a", "b", "c"]) == 3
    now[0] = 5.0
    assert index.expire() == 3  # w0's c, w1's a and b
    assert index.overlaps(["a", "b", "c"]) == {"w0": 2}
    index.predict("w1", ["x"], for_s=5)
    index.drop("w1")
    assert index.overlaps(["x"]) == {}


def test_a_worker_holds_no_more_blocks_than_its_total() -> None:
    index = KvIndex()
    assert index.bound("w0", 4) is None
    batch = KvEventBatch("w0", "i1", 1, [AllBlocksCleared(), BlockStored(["a", "b", "c"])])
    assert index.apply("w0", "1-0", batch) == "applied"
    # a full cache evicts before it stores (one step's batch): never more than its 4 blocks
    step = [BlockStored(["d"]), BlockRemoved(["a", "b"]), BlockStored(["e", "f"])]
    assert index.apply("w0", "2-0", KvEventBatch("w0", "i1", 2, step)) == "applied"
    assert index.blocks("w0") == 4
    assert index.apply("w0", "3-0", _stored(3, "9")) == "overflow"  # a fifth block: its events lie
    assert index.blocks("w0") == 0 and index.overlaps(["c"]) == {} and index.needs_resync("w0")
    assert index.apply("w0", "4-0", _stored(4, "8")) == "stale"  # waits for a snapshot
    too_big = KvSnapshot("w0", "i1", 4, "4-0", ["a", "b", "c", "d", "e"])
    assert index.load("w0", too_big) == "overflow" and not index.usable("w0", too_big)
    assert index.blocks("w0") == 0 and index.needs_resync("w0")
    assert index.load("w0", KvSnapshot("w0", "i1", 4, "4-0", ["a", "b", "c", "d"])) == "resync"
    assert index.blocks("w0") == 4
    assert index.bound("w0", 2) == "overflow"  # its total went down: what it held cannot all be there
    assert index.blocks("w0") == 0 and index.needs_resync("w0")


def test_a_worker_that_reports_no_total_is_held_to_the_constant() -> None:
    assert capacity_limit(0) == UNREPORTED_BLOCKS and capacity_limit(10) == 10
    assert capacity_limit(2**40) == MAX_SNAPSHOT_HASHES  # no more than a snapshot can carry
    index = KvIndex()
    hashes = [format(i, "x") for i in range(UNREPORTED_BLOCKS + 1)]
    assert index.apply("w0", "1-0", _stored(1, *hashes[:-1])) == "applied"
    assert index.apply("w0", "2-0", _stored(2, hashes[-1])) == "overflow"
    assert index.blocks("w0") == 0


def _overflows() -> float:
    return REGISTRY.get_sample_value("splitbus_scheduler_kv_events_total", {"status": "overflow"}) or 0.0


async def test_huge_valid_batches_of_a_small_worker_do_not_swell_the_index(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """The attack: whoever can write a worker's event stream XADDs valid batches of 2**17 hashes
    (8.4 MiB each, ~56 MiB of index each before) and snapshots of as many, for a worker whose
    record says it has 8 blocks. The scheduler keeps at most 8 blocks for it, refuses the big
    entries without decoding them, and goes on indexing the honest worker beside it."""
    registry = Registry(redis, bus_config)
    for worker, total in (("honest", 1000), ("small", 8)):
        load = WorkerLoad(free_kv_blocks=total, total_kv_blocks=total)
        await registry.register(WorkerRecord(worker, "mixed", "m", engine="sim", load=load), lease_ms=60_000)
    honest, small = (KvEventPublisher(redis, bus_config, w) for w in ("honest", "small"))
    await honest.start()
    await small.start()
    chain = [format(i, "016x") for i in range(1, 101)]
    await honest.publish([BlockStored(chain)])
    huge = [format(i, "064x") for i in range(MAX_BATCH_HASHES)]
    await small.publish([BlockStored(huge[:50])])  # small enough to decode: 50 blocks of 8
    await small.publish([BlockStored(huge)])  # 8.4 MiB, twice: refused undecoded
    await small.publish([BlockStored([h[::-1] for h in huge])])
    scheduler = Scheduler(SchedulerConfig(bus_config, mode="mixed", name="s1"))
    try:
        await scheduler.view.refresh()
        before = _overflows()
        await scheduler.follow_kv_events()
        assert scheduler.kv_index.blocks("small") == 0 and _overflows() == before + 3
        snapshot = KvSnapshot("small", small.instance, small.event_id, small._stream_id, sorted(huge))
        await redis.hset(bus_config.keys.kv_snapshot("small"), mapping=for_xadd(codec.encode(snapshot)))
        for _ in range(3):
            await scheduler.follow_kv_events()
            assert scheduler.kv_index.blocks("small") <= 8
        assert _overflows() >= before + 4  # the snapshot (read again each half second while it is there)
        assert scheduler.kv_index.overlaps(huge[:8]) == {}
        assert scheduler.kv_index.overlaps(chain) == {"honest": 100}
    finally:
        await scheduler.redis.aclose()
