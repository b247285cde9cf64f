"""Redis clients with settings that suit the bus (see docs/bus.md, "redis-py settings")."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import AsyncIterator

import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from splitbus.bus.config import BusConfig

log = logging.getLogger(__name__)

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ConnectionError,
    OSError,
)
"""Errors that mean "Redis is unreachable for now": back off and try again."""


def connect(config: BusConfig, *, max_connections: int = 32) -> aioredis.Redis:
    """A client for ``config.redis_url``.

    RESP2 keeps reply shapes identical on Redis 6.2 and 7. Retries are few and short: the
    bus's loops own reconnection (with backoff), so a dead server surfaces in seconds, not the
    minute that redis-py 8's defaults take.
    """
    return aioredis.Redis.from_url(
        config.redis_url,
        protocol=2,
        decode_responses=False,
        socket_timeout=config.socket_timeout_s,
        socket_connect_timeout=min(config.socket_timeout_s, 2.0),
        health_check_interval=15,
        retry=Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.5), retries=2),
        max_connections=max_connections,
    )


async def backoff_delays(base: float = 0.05, cap: float = 2.0) -> AsyncIterator[float]:
    """Sleep with capped exponential backoff and full jitter, yielding each delay slept."""
    attempt = 0
    while True:
        delay = random.uniform(0, min(cap, base * 2**attempt))
        await asyncio.sleep(delay)
        attempt += 1
        yield delay
