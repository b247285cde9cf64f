"""The worker's lease (``splitbus/worker/lease.py``) against real Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.core.config import BusConfig
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.worker.config import WorkerConfig
from splitbus.worker.lease import Lease


async def test_a_primary_that_cannot_be_asked_for_its_run_does_not_keep_the_lease_from_renewal(
    redis: aioredis.Redis, bus_config: BusConfig, tiny_model: Path
) -> None:
    """On a cluster the watch for a new run asks every primary; one that is failing over (one
    that holds only result streams, say) fails that watch for seconds. The beat goes out first:
    the lease is renewed, then the step fails for its loop to retry."""
    config = WorkerConfig(bus=bus_config, role="decode", model_dir=tiny_model, model_name="tiny", worker_id="d0")
    record = WorkerRecord(worker_id="d0", role="decode", model="tiny")

    async def primary_down() -> None:
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:18825. Connection refused.")

    async def nothing() -> None:
        pass

    lease = Lease(
        config.worker_id,
        config.lease_ms,
        redis,
        bus_config.keys,
        Registry(redis, bus_config),
        lambda: record,
        nothing,
        asyncio.Lock(),
        before_beat=primary_down,
    )
    for _ in range(3):
        await redis.delete(bus_config.keys.lease("d0"))
        with pytest.raises(RedisConnectionError):
            await lease.heartbeat()
        assert 0 < await redis.pttl(bus_config.keys.lease("d0")) <= config.lease_ms
