"""The bus's connection pool: redis-py's, with a free connection handed out at once, and a wait
for one only when the pool is full (see docs/bus.md, "redis-py settings")."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import (
    AbstractConnection,
    async_timeout,  # redis-py's choice: asyncio's from 3.11.3 (its issue 2633)
)
from redis.asyncio.observability.recorder import record_connection_count
from redis.auth.token import TokenInterface
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.observability.attributes import ConnectionState, get_pool_name

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
    marked for reconnect is closed as it comes back; redis-py's connection-count metrics; the
    release event, dispatched once a streaming credential provider has asked for
    re-authentication (its one listener). redis-py's lock is still honoured: while a
    re-authentication or a maintenance step holds it to walk the connections, callers wait for it
    as before.

    After a fork the child starts with no connections (as redis-py's synchronous pool does;
    its asyncio pool does not look): the inherited ones are the parent's sockets, dropped here
    without being closed, which the parent goes on using."""

    def __init__(self, *, timeout: float | None = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timeout = timeout
        """How long a caller waits for a connection of a full pool (``None``: for ever)."""
        self._waiters: deque[asyncio.Future[AbstractConnection]] = deque()
        self._pid = os.getpid()
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
        if connection is None:
            connection = await self._wait_for_one()
        try:
            await self._count_taken(connection)
            await self.ensure_connection(connection)
        except BaseException:
            await self.release(connection)
            raise
        return connection

    async def release(self, connection: AbstractConnection) -> None:
        """Give ``connection`` back: to the longest waiter, or to the free list."""
        if self._lock.locked() or connection.should_reconnect():
            try:  # redis-py's own release: under its lock, and a connection marked for reconnect closed first
                await super().release(connection)
            finally:
                self._hand_on()
            return
        self._put_back(connection)
        if self._re_auth:
            await self._finish_release(connection)  # the release event, which re-authenticates, and the counts
        else:
            await self._count(idle=1, used=-1)

    def _take_at_once(self) -> AbstractConnection | None:
        """A connection without waiting, or ``None`` when callers wait before this one or
        redis-py's lock is held (a re-authentication or a maintenance step walking the lists)."""
        if self._waiters or self._lock.locked():
            return None
        return self._take()

    def _take(self) -> AbstractConnection | None:
        """A free connection, else a new one below the cap (not yet connected), marked in use;
        ``None`` at the cap. No ``await`` here: the check and the update are one step."""
        if self._pid != os.getpid():
            self._forked()
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

    def _hand_on(self) -> None:
        """Hand free connections (or room for new ones) to the waiters, longest first."""
        while self._waiters:
            if self._waiters[0].done():  # cancelled or timed out, not yet back on the loop to withdraw
                self._waiters.popleft()
                continue
            connection = self._take()
            if connection is None:
                return
            self._waiters.popleft().set_result(connection)

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
        if waiter.done() and not waiter.cancelled():
            self._put_back(waiter.result())

    def _forked(self) -> None:
        self.reset()
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
