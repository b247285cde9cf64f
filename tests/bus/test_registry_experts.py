"""A MoE worker's expert load in the registry (``WorkerLoad.experts``): written compactly into
its hash by registrations, heartbeats and load reports, never into the registry log; read back
checked, a bad one dropped alone (the worker stays), and kept by a view across beats."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from splitbus.architectures import base as architectures_base
from splitbus.bus.core.config import BusConfig
from splitbus.bus.records import MAX_EXPERTS, ExpertLoad, WorkerLoad
from splitbus.bus.registry import EXPERT_FIELDS, Registry, WorkerRecord
from splitbus.bus.registry_view import RegistryView

PLACED = ExpertLoad(8, (2, 4), (3, 0), (11, 5), weight_bytes=(1000, 64))
"""Rank 1 of 4 of a model with 8 experts per layer: experts 2 and 3."""


def _record(worker_id: str, experts: ExpertLoad | None = PLACED) -> WorkerRecord:
    return WorkerRecord(worker_id, "decode", "tiny", "paddle", load=WorkerLoad(running=1, experts=experts))


def _rejected() -> float:
    return REGISTRY.get_sample_value("splitbus_bus_registry_rows_rejected_total", {"source": "experts"}) or 0.0


def test_the_bus_bounds_experts_as_the_models_do() -> None:
    assert MAX_EXPERTS == architectures_base.MAX_EXPERTS


async def test_the_expert_load_is_in_the_hash_and_the_snapshot_not_in_the_log(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("d1"), lease_ms=5000)
    stored = await redis.hgetall(bus_config.keys.worker("d1"))
    assert {k.decode(): v.decode() for k, v in stored.items() if k.decode() in EXPERT_FIELDS} == {
        "experts_per_layer": "8",
        "experts_first": "2",
        "experts_end": "4",
        "expert_tokens_last": "3,0",
        "expert_tokens_total": "11,5",
        "weight_bytes_dense": "1000",
        "weight_bytes_experts": "64",
    }
    (row,) = await registry.snapshot()
    assert row.record.load.experts == PLACED and row.record.load.running == 1

    beat = ExpertLoad(8, (2, 4), (0, 7), (11, 12), weight_bytes=(1000, 64))
    await registry.heartbeat("d1", WorkerLoad(running=2, experts=beat), lease_ms=5000)
    (row,) = await registry.snapshot()
    assert row.record.load.experts == beat and row.record.load.running == 2
    step = ExpertLoad(8, (2, 4), (1, 1), (12, 13), weight_bytes=(1000, 64))
    await registry.report_load("d1", WorkerLoad(running=3, experts=step))  # a DP rank's step writes the same way
    (row,) = await registry.snapshot()
    assert row.record.load.experts == step and row.record.load.running == 3

    entries = await redis.xrange(bus_config.keys.registry_log)
    assert len(entries) == 3 and all(b"running" in fields for _, fields in entries)
    assert not [name for _, fields in entries for name in fields if name.decode() in EXPERT_FIELDS]


async def test_a_worker_without_experts_under_the_same_id_shows_none(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("w"), lease_ms=5000)
    await registry.register(_record("w", experts=None), lease_ms=5000)  # restarted with a dense model
    assert not set(EXPERT_FIELDS) & {k.decode() for k in await redis.hgetall(bus_config.keys.worker("w"))}
    (row,) = await registry.snapshot()
    assert row.record.load.experts is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("experts_per_layer", str(MAX_EXPERTS + 1)),
        ("experts_per_layer", "3"),  # fewer than the held range's end
        ("experts_first", "4"),  # an empty range
        ("experts_end", "-4"),
        ("weight_bytes_experts", "-1"),
        ("expert_tokens_last", "3"),  # one count for two held experts
        ("expert_tokens_last", "3,0,0"),
        ("expert_tokens_total", "11,x"),
        ("expert_tokens_total", "11, 5"),
        ("expert_tokens_total", f"11,{2**63}"),
        ("expert_tokens_total", "1," * 100_000 + "1"),
        ("expert_tokens_last", None),  # missing
    ],
)
async def test_a_bad_expert_load_is_dropped_alone_and_counted(
    redis: aioredis.Redis, bus_config: BusConfig, name: str, value: str | None
) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("w"), lease_ms=5000)
    key = bus_config.keys.worker("w")
    await (redis.hset(key, name, value) if value is not None else redis.hdel(key, name))
    before = _rejected()
    (row,) = await registry.snapshot()  # the worker stays: nothing places requests by its experts
    assert row.record.load.experts is None and row.record.load.running == 1
    assert _rejected() == before + 1


def test_the_record_reads_back_what_it_wrote_with_and_without_experts() -> None:
    for record in (_record("w"), _record("w", experts=None)):
        assert WorkerRecord.from_hash(record.to_hash()) == record
    whole = ExpertLoad(MAX_EXPERTS, (0, MAX_EXPERTS), (2**63 - 1,) * MAX_EXPERTS, (0,) * MAX_EXPERTS)
    assert WorkerRecord.from_hash(_record("w", whole).to_hash()).load.experts == whole


async def test_a_view_keeps_the_snapshots_expert_load_across_beats(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry = Registry(redis, bus_config)
    await registry.register(_record("d1"), lease_ms=5000)
    view = RegistryView(registry, redis, full_every_s=3600)
    await view.refresh()
    await registry.register(_record("d1", ExpertLoad(8, (2, 4), (9, 9), (20, 14))), lease_ms=5000)
    await registry.report_load("d1", WorkerLoad(running=4, experts=PLACED))
    await view.follow()
    await view.follow()
    (row,) = view.workers
    assert row.record.load.running == 4  # the log's changes came in
    assert row.record.load.experts == PLACED  # as of the snapshot: the log does not carry them
