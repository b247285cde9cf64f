"""The planner's advice in Redis (splitbus/bus/planner.py): written with its expiry in one round
trip, read back whole on a sync client, every field checked, under the cell's hash tag."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from redis.crc import key_slot

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.keys import Keys
from splitbus.bus.planner import FIELDS, Advice, Reason, publish, read_advice
from splitbus.redis_cluster import EmbeddedCluster

ADVICE = Advice(
    at_ms=1_764_000_000_000,
    interval_ms=5000,
    predictor="peak",
    arrivals_rps=12.5,
    predicted_rps=14.0,
    prompt_tokens=1024.0,
    hit_ratio=0.25,
    output_tokens=128.0,
    prefill_tokens_per_s=9800.5,
    batch_at_slo=140,
    desired_prefill=4,
    desired_decode=8,
    groups_prefill=4,
    groups_decode=2,
    actual_prefill=2,
    actual_decode=8,
    draining_prefill=0,
    draining_decode=1,
    reason_prefill=Reason.SLO,
    reason_decode=Reason.KV_BOUND,
)


async def test_written_read_back_and_expiring(
    redis: aioredis.Redis, redis_admin: sync_redis.Redis, bus_config: BusConfig
) -> None:
    assert read_advice(redis_admin, bus_config.keys) is None  # no planner yet
    await publish(redis, bus_config.keys, ADVICE)
    assert read_advice(redis_admin, bus_config.keys) == ADVICE
    assert 10_000 < await redis.pttl(bus_config.keys.planner) <= 15_000  # three intervals
    unmeasured = dataclasses.replace(ADVICE, prefill_tokens_per_s=None, batch_at_slo=None, at_ms=ADVICE.at_ms + 1)
    await publish(redis, bus_config.keys, unmeasured)
    assert read_advice(redis_admin, bus_config.keys) == unmeasured  # "" in the hash: the old figures are gone
    assert ADVICE.desired("prefill") == 4 and ADVICE.desired("decode") == 8


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("desired_prefill", "-1"),
        ("desired_decode", "10001"),
        ("actual_prefill", " 3"),
        ("reason_decode", "because"),
        ("hit_ratio", "1.5"),
        ("arrivals_rps", "nan"),
        ("predicted_rps", "inf"),
        ("output_tokens", "-3.0"),
        ("prefill_tokens_per_s", "1_000"),
        ("predictor", "Peak; DROP"),
        ("at_ms", "9" * 40),
        ("interval_ms", "86400000"),
    ],
)
def test_a_forged_field_is_refused_by_name(field: str, value: str) -> None:
    raw = ADVICE.to_hash() | {field: value}
    with pytest.raises(DecodeError, match=field):
        Advice.from_hash(raw)


def test_a_missing_field_is_refused_and_others_are_ignored() -> None:
    raw = ADVICE.to_hash()
    assert Advice.from_hash(raw | {"extra": "x" * 1000}) == ADVICE
    del raw["reason_prefill"]
    with pytest.raises(DecodeError, match="missing reason_prefill"):
        Advice.from_hash(raw)


async def test_a_forged_hash_read_on_a_sync_client_is_refused(
    redis: aioredis.Redis, redis_admin: sync_redis.Redis, bus_config: BusConfig
) -> None:
    await redis.hset(bus_config.keys.planner, mapping=ADVICE.to_hash() | {"desired_decode": "9" * 10_000})
    with pytest.raises(DecodeError, match="desired_decode"):
        read_advice(redis_admin, bus_config.keys)


def test_the_key_is_in_the_cells_slot() -> None:
    keys = Keys(cell="east-2")
    assert keys.planner == "sb:planner:{east-2}"
    assert key_slot(keys.planner.encode()) == key_slot(b"east-2") == key_slot(keys.workers.encode())


def test_every_field_is_in_the_hash() -> None:
    assert tuple(ADVICE.to_hash()) == FIELDS


class _BytesClient:
    """A sync client without ``decode_responses``: the hash as bytes."""

    def __init__(self, raw: dict[bytes, bytes]) -> None:
        self.raw = raw

    def hgetall(self, name: str) -> object:
        return self.raw


def test_a_hash_read_as_bytes_is_decoded_and_a_huge_value_refused_undecoded() -> None:
    raw = {name.encode(): value.encode() for name, value in ADVICE.to_hash().items()}
    assert read_advice(_BytesClient(raw), Keys()) == ADVICE
    with pytest.raises(DecodeError, match="batch_at_slo"):
        read_advice(_BytesClient(raw | {b"batch_at_slo": b"\xff" * 10_000_000}), Keys())


async def test_written_and_read_on_a_redis_cluster(redis_cluster: EmbeddedCluster) -> None:
    config = BusConfig(redis_url=redis_cluster.url, prefix=f"t{uuid.uuid4().hex[:10]}")
    client = connect(config, name="t-planner")
    reader = redis_cluster.client()
    try:
        await publish(client, config.keys, ADVICE)
        assert read_advice(reader, config.keys) == ADVICE
    finally:
        reader.close()
        await client.aclose()
