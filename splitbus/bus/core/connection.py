"""Redis clients with settings that suit the bus (see docs/bus.md, "redis-py settings")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ClusterDownError, OutOfMemoryError, ReadOnlyError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from splitbus.bus.core.cluster import BusCluster, is_cluster_url, parse_cluster_url
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.pool import BusPool
from splitbus.bus.core.wire import BusConnection, closed_transport

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,  # BusyLoadingError (LOADING) is one
    RedisTimeoutError,
    ConnectionError,
    OSError,
    OutOfMemoryError,  # OOM: at maxmemory with noeviction, writes are refused until memory frees
    ReadOnlyError,  # READONLY: a replica, or a failover under way
    ClusterDownError,  # CLUSTERDOWN, and MASTERDOWN (its subclass)
    TryAgainError,  # TRYAGAIN: a slot migrating
)
"""Errors that mean "Redis cannot serve this for now": back off and try again. Sites that
catch errors themselves use this tuple; a loop asks :func:`is_transient`, which also knows the
codes redis-py has no class for and the same errors raised inside a script."""

TRANSIENT_CODES = (
    "OOM",
    "BUSY",
    "LOADING",
    "READONLY",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "MISCONF",
    "NOREPLICAS",
)
"""Error codes of refusals that end by themselves: BUSY (a script or module running past its time
limit), MISCONF (a failed background save stops writes until one succeeds), NOREPLICAS
(min-replicas-to-write not met), and those with classes above. Redis 6.2 reports a refusal met
inside a script as ``ERR Error running script (...): @user_script:1: -OOM command not allowed``,
so the code is looked for after a ``-`` too."""
_SCRIPT_ERROR = re.compile(r"-(" + "|".join(TRANSIENT_CODES) + r")\b")


def connect(config: BusConfig, *, max_connections: int = 32, name: str | None = None) -> aioredis.Redis:
    """A client for ``config.redis_url`` holding at most ``max_connections`` connections (on a
    cluster: per node).

    A full pool makes callers wait for a connection, in turn
    (:class:`~splitbus.bus.core.pool.BusPool`, which hands a free one out without the blocking
    pool's locking on every command; redis-py's default pool raises at once; on a cluster,
    commands wait for one of ``max_connections`` places instead, and for a connection of a full
    node pool: :class:`~splitbus.bus.core.cluster.BusCluster`). RESP2 keeps reply shapes
    identical on Redis 6.2 and 7. Retries are few and short, of connection errors only: the bus's
    loops own reconnection (with backoff), so a dead server surfaces in seconds, not the minute
    that redis-py 8's defaults take. ``name`` is set with CLIENT SETNAME, so ``redis-cli CLIENT LIST`` shows which
    part holds which connection.
    A ``redis+cluster://`` URL gives a ``RedisCluster`` with the same settings (see
    :func:`connect_cluster`).
    """
    if is_cluster_url(config.redis_url):
        # The cluster client has the command methods of a single-Redis one (they share their
        # command mixins), which is all the bus calls on it; the few places where the two differ
        # ask splitbus.bus.core.cluster.as_cluster. One cast here, not a union in every signature.
        return cast(aioredis.Redis, connect_cluster(config, max_connections=max_connections, name=name))
    pool = BusPool.from_url(
        config.redis_url,
        max_connections=max_connections,
        timeout=config.socket_timeout_s,
        connection_class=BusConnection,
        **_client_settings(config, name),
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes both


def connect_cluster(config: BusConfig, *, max_connections: int = 32, name: str | None = None) -> aioredis.RedisCluster:
    """A cluster client for a ``redis+cluster://`` or ``rediss+cluster://`` URL, with the bus's timeouts and retries. It
    follows MOVED and ASK itself, and after a connection error reads the slot map again before
    its next command, so after a failover the next command finds the new primary.
    ``require_full_coverage`` off, as on the embedded cluster: while one primary fails over,
    the others' slots stay served."""
    url = parse_cluster_url(config.redis_url)
    client = BusCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in url.nodes],
        max_connections=max_connections,
        require_full_coverage=False,
        **_client_settings(config, name),
        **url.client_settings(),  # user, password and, for rediss+cluster://, TLS with the nodes verified
    )
    client.pool_wait_s = config.socket_timeout_s  # as the single Redis's blocking pool waits
    return client


def _client_settings(config: BusConfig, name: str | None) -> dict[str, Any]:
    """What every bus client, single or cluster, connects with."""
    return {
        "client_name": name,
        "protocol": 2,
        "decode_responses": False,
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": min(config.socket_timeout_s, 2.0),
        "health_check_interval": 15,
        # A timeout is not retried: the command may have run (a blocked read may have been handed
        # entries), so it reaches the caller, and the task feed looks for what that read was
        # handed at once. The cluster client retries by its own list, with this one's count.
        "retry": Retry(
            ExponentialWithJitterBackoff(base=0.02, cap=0.5), retries=2, supported_errors=(RedisConnectionError,)
        ),
    }


def connect_sync(url: str, **settings: Any) -> redis.Redis:
    """A synchronous client for ``url`` (the CLI's and benchmarks' short-lived clients):
    ``redis.Redis.from_url`` as before, or a ``redis.RedisCluster`` for a ``redis+cluster://``
    URL (or ``rediss+cluster://``). ``settings`` are redis-py's (``socket_timeout``, ``decode_responses``, ...)."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **settings)
    parsed = parse_cluster_url(url)
    cluster = redis.RedisCluster(
        startup_nodes=[redis.cluster.ClusterNode(host, port) for host, port in parsed.nodes],
        require_full_coverage=False,
        **parsed.client_settings(sync=True),
        **settings,
    )
    return cast(redis.Redis, cluster)  # as in connect(): the same command methods


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
        except Exception as exc:
            if not is_transient(exc):
                raise


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` means Redis refuses or cannot be reached for now (back off, retry), as
    opposed to an error that retrying cannot fix."""
    if isinstance(exc, TRANSIENT_ERRORS) or closed_transport(exc):  # the latter: met outside a guarded write
        return True
    if not isinstance(exc, ResponseError):
        return False
    text = str(exc)
    return text.split(" ", 1)[0] in TRANSIENT_CODES or _SCRIPT_ERROR.search(text) is not None


async def forever(step: Callable[[], Awaitable[object]], stop: Callable[[], bool], name: str) -> None:
    """Call ``step`` until ``stop()``: the one loop shape of every long-running part, and its one
    error policy.

    A transient Redis error (:func:`is_transient`: unreachable, LOADING, OOM, BUSY, READONLY...)
    is waited out with capped, jittered backoff, and the step runs again; the loop never ends on
    one, and what the step buffers (results, acks, dead letters) stays buffered until Redis takes
    it. Any other exception propagates: steps contain the failures of the entries they handle
    (each is dead-lettered and its request failed), so what reaches here is a bug in the loop
    itself, and the process ends with a non-zero exit code for its supervisor to restart it.
    """
    delays: AsyncIterator[float] | None = None
    while not stop():
        try:
            await step()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if delays is None:
                log.warning("%s: Redis refuses or is unreachable (%s); backing off", name, exc)
                delays = backoff_delays()
            await anext(delays)
        else:
            if delays is not None:
                log.info("%s: Redis is back", name)
                delays = None


@contextlib.contextmanager
def transient_suppressed(what: str) -> Iterator[None]:
    """For a write that may wait or be dropped (an advisory report, a last flush on the way
    out): a transient Redis error is logged and swallowed, any other propagates."""
    try:
        yield
    except Exception as exc:
        if not is_transient(exc):
            raise
        log.warning("%s skipped: Redis refuses or is unreachable (%s)", what, exc)


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
        except Exception as exc:
            if not is_transient(exc) or stop():
                raise
            log.warning("Redis unavailable at %s (%s); retrying", what, exc)
            await wait_until_reachable(redis, stop)
