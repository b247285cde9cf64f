"""Cancellation stream: every listener sees every cancellation published after it started."""

from __future__ import annotations

import redis.asyncio as aioredis

from splitbus.bus.cancel import CancelListener, publish_cancel
from splitbus.bus.core.config import BusConfig


async def test_every_listener_sees_new_cancellations(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    await publish_cancel(redis, bus_config, "before", "old")
    listeners = [CancelListener(redis, bus_config) for _ in range(3)]
    for listener in listeners:
        await listener.start()
    await publish_cancel(redis, bus_config, "r1", "client_disconnected")
    await redis.xadd(bus_config.keys.cancel, {b"type": b"cancel", b"data": b"{}"})  # malformed
    await publish_cancel(redis, bus_config, "r2", "deadline")
    for listener in listeners:
        got = await listener.poll(block_ms=100)
        assert [(c.request_id, c.reason) for c in got] == [("r1", "client_disconnected"), ("r2", "deadline")]
        assert await listener.poll(block_ms=10) == []
