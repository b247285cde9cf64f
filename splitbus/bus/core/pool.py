"""The bus's connection pool: redis-py's, with a free connection handed out at once, and a wait
for one only when the pool is full (see docs/bus.md, "redis-py settings")."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import (
    AbstractConnection,
    async_timeout,  # redis-py's choice: asyncio's from 3.11.3 (its issue 2633)
)
from redis.asyncio.observability.recorder import (
    record_connection_count,
    record_connection_create_time,
    record_connection_timeout,
    record_connection_wait_time,
)
from redis.auth.token import TokenInterface
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.observability.attributes import ConnectionState, get_pool_name

logger = logging.getLogger(__name__)

NO_CONNECTION = "No connection available."
"""What a wait past the timeout raises (a ``ConnectionError``), word for word as redis-py's
``BlockingConnectionPool`` says it, so that nothing that reads it changes."""


class BusPool(aioredis.ConnectionPool):
    """At most ``max_connections`` connections; a caller that finds them all in use waits up to
    ``timeout`` seconds (``None``: for ever) for one, then gets ``ConnectionError("No connection
    available.")``: what redis-py's ``BlockingConnectionPool`` does, for less per command.

    Why not the blocking pool: to hand out a connection it enters an ``asyncio.Condition``, a
    timeout context and the pool's lock, and to take one back the ``Condition`` and the lock
    again, on every command, whether or not anyone waits: 7–10 µs of a 45 µs ``PING``
    (``splitbus bench client``, ``bus-connect`` against ``bus-settings``). Here taking and giving
    back are plain list and set updates, done without a suspension point between the check and
    the update (what the lock buys on one event loop), and only a caller that finds the pool full
    waits, on a future of its own. A released connection goes to the longest waiter directly,
    so a caller arriving later cannot take it first (first come, first served, as the
    ``Condition``'s order gives).

    Kept from redis-py's pool: its bookkeeping (``_available_connections``,
    ``_in_use_connections``), so ``disconnect``, ``aclose``, ``set_retry`` and the connection
    counts work unchanged; the check of a connection before it is handed out
    (``ensure_connection``: reconnect a dropped one, refuse one with unread data); a connection
    marked for reconnect is closed as it comes back; redis-py's metrics: the connection counts,
    and on the waiting path (the only one the blocking pool had) the wait, the timeout and the
    time to make a connection; the release event, dispatched once a streaming credential provider
    has asked for re-authentication (its one listener), before the connection is free again, so
    that no one is handed it in the middle of its ``AUTH``. redis-py's lock is still honoured:
    while a re-authentication or a maintenance step holds it to walk the connections, callers wait
    for it, and nothing here changes the lists under it (what would be done then is done once
    the lock is free).

    After a fork the child starts with no connections (as redis-py's synchronous pool does;
    its asyncio pool does not look) and a lock of its own. The inherited connections are the
    parent's sockets, which the parent goes on using: the child keeps them, untouched, for its
    whole life, because a connection that is garbage-collected closes its transport, and in a
    child that shares its parent's event-loop selector that takes the parent's socket out of the
    parent's selector too."""

    def __init__(self, *, timeout: float | None = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timeout = timeout
        """How long a caller waits for a connection of a full pool (``None``: for ever)."""
        self._waiters: deque[asyncio.Future[AbstractConnection]] = deque()
        self._pid = os.getpid()
        self._inherited: list[AbstractConnection] = []
        """After a fork, the parent's connections: held, never used or closed (see the class)."""
        self._fresh: set[AbstractConnection] = set()
        """Connections made for a caller that has not had them yet (they were never idle)."""
        self._re_auth = False
        """Whether a streaming credential provider has handed connections a new token: only then
        does a release dispatch redis-py's release event, whose one listener re-authenticates
        (1.7 µs a command otherwise spent on an event with nothing to do)."""

    async def get_connection(self, command_name: Any = None, *keys: Any, **options: Any) -> AbstractConnection:
        """A connected connection: at once when one is free and no one waits before this caller,
        else after a wait (see the class)."""
        connection = self._take_at_once()
        waited_since = made_since = None
        if connection is None:
            waited_since = time.monotonic()
            connection = await self._wait_for_one()
            made_since = time.monotonic() if connection in self._fresh else None
        try:  # inline, not a helper coroutine: this is every command's path
            await self._count_taken(connection)
            await self.ensure_connection(connection)
        except BaseException:
            await self._release_quietly(connection)
            raise
        if waited_since is not None:
            await self._record_wait(waited_since, made_since)
        return connection

    async def _record_wait(self, waited_since: float, made_since: float | None) -> None:
        """redis-py's wait metrics, on the waiting path only, as its blocking pool recorded them:
        the wait (to a connected connection) and, for a connection made for this caller, its
        connect."""
        now = time.monotonic()
        if made_since is not None:
            await record_connection_create_time(connection_pool=self, duration_seconds=now - made_since)
        await record_connection_wait_time(pool_name=get_pool_name(self), duration_seconds=now - waited_since)

    async def _release_quietly(self, connection: AbstractConnection) -> None:
        try:
            await self.release(connection)
        except Exception:  # the connection is back; the caller's own error is the one that matters
            logger.warning("giving back a connection that failed its check failed too", exc_info=True)

    async def release(self, connection: AbstractConnection) -> None:
        """Give ``connection`` back: to the longest waiter, or to the free list."""
        if self._lock.locked() or connection.should_reconnect():
            try:  # redis-py's own release: under its lock, and a connection marked for reconnect closed first
                await super().release(connection)
            finally:
                self._hand_on()
            return
        if self._re_auth:
            try:  # the release event (re-authentication) and the counts, while no one else can have it
                await self._finish_release(connection)
            finally:
                self._give_back(connection)
            return
        self._put_back(connection)
        await self._count(idle=1, used=-1)

    def _take_at_once(self) -> AbstractConnection | None:
        """A connection without waiting, or ``None`` when callers wait before this one or
        redis-py's lock is held (a re-authentication or a maintenance step walking the lists)."""
        if self._pid != os.getpid():  # before the lock's check: a forked child must not wait on its parent's lock
            self._forked()
        if self._waiters or self._lock.locked():
            return None
        return self._take()

    def _take(self) -> AbstractConnection | None:
        """A free connection, else a new one below the cap (not yet connected), marked in use;
        ``None`` at the cap. No ``await`` here: the check and the update are one step."""
        if self._available_connections:
            connection = self._available_connections.pop()
        elif len(self._in_use_connections) < self.max_connections:
            connection = self.make_connection()
            self._fresh.add(connection)
        else:
            return None
        self._in_use_connections.add(connection)
        return connection

    def _put_back(self, connection: AbstractConnection) -> None:
        # remove(), not discard(): a connection of another pool is an error, as in redis-py's pool
        self._in_use_connections.remove(connection)
        self._available_connections.append(connection)
        self._hand_on()

    def _give_back(self, connection: AbstractConnection) -> None:
        """``_put_back``, or once redis-py's lock is free when someone holds it."""
        if self._lock.locked():
            self._when_lock_free(partial(self._put_back, connection))
        else:
            self._put_back(connection)

    def _hand_on(self) -> None:
        """Hand free connections (or room for new ones) to the waiters, longest first; once
        redis-py's lock is free when someone holds it (the lists are theirs to walk)."""
        if self._lock.locked():
            if self._waiters:
                self._when_lock_free(self._hand_on)
            return
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.done():  # cancelled or timed out, not yet back on the loop to withdraw
                self._waiters.popleft()
                continue
            try:
                connection = self._take()
            except Exception as exc:  # make_connection failed: the waiter it was for gets the error
                self._waiters.popleft().set_exception(exc)
                continue
            if connection is None:
                return
            self._waiters.popleft().set_result(connection)

    def _when_lock_free(self, step: Callable[[], None]) -> None:
        self._run_in_background(self._after_lock(step))  # redis-py's: the task held, a failure logged

    async def _after_lock(self, step: Callable[[], None]) -> None:
        await self._lock_free()
        step()

    async def _wait_for_one(self) -> AbstractConnection:
        waiter: asyncio.Future[AbstractConnection] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with async_timeout(self.timeout):
                await self._lock_free()
                self._hand_on()  # a connection may be free: the queue held only this caller, or ones that gave up
                return await waiter
        except BaseException as exc:
            self._withdraw(waiter)
            if isinstance(exc, asyncio.TimeoutError):  # TimeoutError itself from 3.11
                await record_connection_timeout(pool_name=get_pool_name(self))
                raise RedisConnectionError(NO_CONNECTION) from exc
            raise

    async def _lock_free(self) -> None:
        while self._lock.locked():
            async with self._lock:
                pass

    def _withdraw(self, waiter: asyncio.Future[AbstractConnection]) -> None:
        """A waiter that ends without its connection leaves the queue; a connection handed to it
        as it was cancelled (or timed out) goes on to the next."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            self._give_back(waiter.result())

    def _forked(self) -> None:
        """In a forked child: start empty, keeping the parent's connections (see the class)."""
        self._inherited.extend(self._available_connections)
        self._inherited.extend(self._in_use_connections)
        self._available_connections = []
        self._in_use_connections = set()
        self._lock = asyncio.Lock()  # the parent's may be held, and is bound to the parent's loop
        self._waiters.clear()
        self._fresh.clear()
        self._pid = os.getpid()

    async def re_auth_callback(self, token: TokenInterface) -> None:
        self._re_auth = True  # from now on a connection given back re-authenticates if it was handed a new token
        await super().re_auth_callback(token)

    async def _count_taken(self, connection: AbstractConnection) -> None:
        if connection in self._fresh:  # made for this caller: it was never idle
            self._fresh.discard(connection)
            await self._count(idle=0, used=1)
        else:
            await self._count(idle=-1, used=1)

    async def _count(self, idle: int, used: int) -> None:
        # redis-py's connection-count metrics (OpenTelemetry), recorded as its pool records them:
        # no-ops unless configured, about 0.8 µs a command each way.
        name = get_pool_name(self)
        if idle:
            await record_connection_count(pool_name=name, connection_state=ConnectionState.IDLE, counter=idle)
        await record_connection_count(pool_name=name, connection_state=ConnectionState.USED, counter=used)
