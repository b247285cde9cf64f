"""The bus's connection to one Redis server, a single Redis or a cluster node (docs/bus.md,
"redis-py settings"): redis-py's, plain or TLS, guarded for two things a write can meet
(:class:`GuardedWrites`). Apart from :mod:`splitbus.bus.core.connection`, whose ``connect`` builds
single-Redis pools of them, so that :mod:`splitbus.bus.core.cluster` can give every node of a
cluster client the same class without importing the module that imports it."""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Iterable, Mapping
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError


class GuardedWrites(AbstractConnection):
    """A redis-py connection, but for two things a write can meet (mixed into
    :class:`BusConnection` and :class:`BusSSLConnection`, before redis-py's class).

    **A transport closed under it.** uvloop raises ``RuntimeError: unable to perform operation on
    <TCPTransport closed=True ...>; the handler is closed`` (seen when the server died while the
    connection was being set up): that is the ``ConnectionError`` it is, which redis-py retries
    on a new connection and the bus backs off on, as after a reset.

    **A cancel that arrives as the write completes.** redis-py bounds a write with
    ``asyncio.wait_for``, which on Python 3.11 returns the write's result when the cancel and the
    write's end meet in one turn of the loop: the cancel is lost, and a cancelled loop runs on
    (seen with redis-py 8.2: a control server's task, cancelled, kept serving). Here the cancel is
    raised once the write returns, and the connection dropped: the command's reply will never be
    read, and must not be read as the next command's."""

    async def send_packed_command(self, command: bytes | str | Iterable[bytes], check_health: bool = True) -> None:
        cancels = cancels_requested()
        try:
            await super().send_packed_command(command, check_health)
        except RuntimeError as exc:
            if not closed_transport(exc):
                raise
            raise RedisConnectionError(f"the connection closed under a write ({exc})") from None
        if cancels_requested() > cancels:
            await self.disconnect(nowait=True)
            raise asyncio.CancelledError("cancelled as the write completed")


class BusConnection(GuardedWrites, aioredis.Connection):
    """redis-py's TCP connection, its writes guarded (:class:`GuardedWrites`)."""


class BusSSLConnection(GuardedWrites, aioredis.SSLConnection):
    """redis-py's TLS connection, its writes guarded (:class:`GuardedWrites`), that trusts its
    ``ssl_ca_certs`` alone where it names one (:func:`pinned_context`)."""

    def _connection_arguments(self) -> Mapping[str, Any]:
        arguments = dict(super()._connection_arguments())
        if self.ca_certs is not None:
            arguments["ssl"] = pinned_context(self.ca_certs, self.certfile, self.keyfile, self.check_hostname)
        return arguments


class PinnedSSLConnection(redis.SSLConnection):
    """redis-py's synchronous TLS connection, trusting its ``ssl_ca_certs`` alone where it names
    one (:func:`pinned_context`): the CLI's, the tests' and the embedded cluster's own clients."""

    def _build_ssl_context(self) -> ssl.SSLContext:
        if self.ca_certs is None:
            return super()._build_ssl_context()
        return pinned_context(self.ca_certs, self.certfile, self.keyfile, self.check_hostname)


@functools.lru_cache(maxsize=16)
def pinned_context(ca_certs: str, certfile: str | None, keyfile: str | None, check_hostname: bool) -> ssl.SSLContext:
    """A TLS client context that verifies the server's certificate against ``ca_certs`` and no
    other CA. redis-py starts from ``ssl.create_default_context()``, which loads the system's
    trusted CAs, and adds ``ssl_ca_certs`` to them: a listener with a certificate from any CA of
    the system store (a company's, mkcert's; with host names unchecked, any public one) then passed
    as a cluster node and was sent the password. One context per set of files, as redis-py shares
    its own (a certificate reissued under the same CA is read by the next process)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, host names checked
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = check_hostname
    context.load_verify_locations(cafile=ca_certs)
    if certfile:
        context.load_cert_chain(certfile, keyfile)
    return context


def guarded(connection_class: type[aioredis.Connection]) -> type[aioredis.Connection]:
    """The bus's class for redis-py's ``connection_class`` (a bus class stays itself). Any other
    class is a TypeError, not left unguarded: a redis-py that picks another class for its
    cluster nodes fails the first client it builds, in the tests, rather than running without
    the guards."""
    if issubclass(connection_class, GuardedWrites):
        return connection_class
    if connection_class is aioredis.SSLConnection:
        return BusSSLConnection
    if connection_class is aioredis.Connection:
        return BusConnection
    raise TypeError(f"no guarded form of {connection_class.__qualname__} for the bus")


def cancels_requested() -> int:
    """How many cancels of the current task are pending: 0 outside a task, and on Python 3.10,
    which does not count them (a cancel its ``wait_for`` loses stays lost there; 3.12's
    ``wait_for`` no longer loses one)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling() if cancelling is not None else 0


def closed_transport(exc: BaseException) -> bool:
    """Whether ``exc`` is uvloop's error for a write to a closed transport (a lost connection)."""
    return isinstance(exc, RuntimeError) and "handler is closed" in str(exc)
