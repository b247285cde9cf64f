"""Redis clients with settings that suit the bus (see docs/bus.md, "redis-py settings")."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from splitbus.bus.config import BusConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ConnectionError,
    OSError,
)
"""Errors that mean "Redis is unreachable for now": back off and try again."""


def connect(config: BusConfig, *, max_connections: int = 32, name: str | None = None) -> aioredis.Redis:
    """A client for ``config.redis_url`` holding at most ``max_connections`` connections.

    A full pool makes callers wait for a connection (redis-py's default pool raises at once).
    RESP2 keeps reply shapes identical on Redis 6.2 and 7. Retries are few and short: the
    bus's loops own reconnection (with backoff), so a dead server surfaces in seconds, not the
    minute that redis-py 8's defaults take. ``name`` is set with CLIENT SETNAME, so
    ``redis-cli CLIENT LIST`` shows which part holds which connection.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        config.redis_url,
        max_connections=max_connections,
        timeout=config.socket_timeout_s,
        client_name=name,
        protocol=2,
        decode_responses=False,
        socket_timeout=config.socket_timeout_s,
        socket_connect_timeout=min(config.socket_timeout_s, 2.0),
        health_check_interval=15,
        retry=Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.5), retries=2),
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes both


async def backoff_delays(base: float = 0.05, cap: float = 2.0) -> AsyncIterator[float]:
    """Sleep with capped exponential backoff and full jitter, yielding each delay slept."""
    attempt = 0
    while True:
        delay = random.uniform(0, min(cap, base * 2**attempt))
        await asyncio.sleep(delay)
        attempt += 1
        yield delay


async def wait_until_reachable(redis: aioredis.Redis, stop: Callable[[], bool] = lambda: False) -> None:
    """Back off (capped, jittered) until Redis answers PING, or until ``stop()`` is true."""
    async for _ in backoff_delays():
        if stop():
            return
        try:
            await redis.ping()
            return
        except TRANSIENT_ERRORS:
            continue


async def until_done(
    action: Callable[[], Awaitable[T]], redis: aioredis.Redis, stop: Callable[[], bool], what: str
) -> T:
    """``action()`` until Redis lets it through: for start-up steps, which run before any loop
    that would back off. LOADING (a restarted Redis reading its AOF) is a ConnectionError for
    redis-py, so it waits here like an unreachable server does. Raises the last error once
    ``stop()`` is true."""
    while True:
        try:
            return await action()
        except TRANSIENT_ERRORS as exc:
            if stop():
                raise
            log.warning("Redis unavailable at %s (%s); retrying", what, exc)
            await wait_until_reachable(redis, stop)
