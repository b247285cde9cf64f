"""Redis Cluster on the bus: the ``redis+cluster://`` and ``rediss+cluster://`` URLs, and the few
commands that a cluster client sends differently (docs/cluster.md).

The same code runs on a single Redis and on a cluster. Where the two clients differ, the bus asks
:func:`as_cluster` and takes the cluster path only on a cluster, so a single Redis gets exactly
the commands it got before:

- blocking reads (``XREAD``, ``XREADGROUP``) name the primary of their slot: routed by redis-py,
  each costs two ``COMMAND GETKEYS`` round trips (their keys move with their arguments);
- result-reader tags are picked per primary from the slot map (:class:`SlotMap`), not hashed
  wherever they land.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPipeline
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import MaxConnectionsError, SlotNotCoveredError
from redis.typing import EncodableT, KeyT, StreamIdT

from splitbus.bus.core.wire import PinnedSSLConnection, guarded

SCHEME = "redis+cluster"
TLS_SCHEME = "rediss+cluster"
MAX_NODES = 1000
"""Startup nodes one URL may name (a bound on what an environment variable makes us hold)."""
_HOST = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)$")
"""A host name, an IPv4 address or a bracketed IPv6 one."""
DEFAULT_PORT = 6379
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
"""What a ``rediss+cluster://`` URL's query may set: redis-py's names for ``rediss://``."""
_BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


@dataclass(frozen=True)
class ClusterTls:
    """TLS to every node of a cluster, the nodes' certificates always verified: a listener that
    cannot show one the CA signed (for the host the client dialled, unless ``check_hostname`` is
    off) gets a failed handshake, never the user's password."""

    ca_certs: str | None = None
    """The CA file the nodes' certificates must chain to (None: the system's trusted CAs)."""
    certfile: str | None = None
    """The client certificate, for a cluster that asks for one (``tls-auth-clients yes``)."""
    keyfile: str | None = None
    check_hostname: bool = True

    def settings(self, sync: bool = False) -> dict[str, Any]:
        """redis-py's keyword arguments, for the bus's asyncio cluster client (whose nodes connect
        on :class:`~splitbus.bus.core.wire.BusSSLConnection`) or, ``sync``, a synchronous one (on
        :class:`~splitbus.bus.core.wire.PinnedSSLConnection`): either trusts ``ca_certs`` alone."""
        return {
            "ssl": True,
            "ssl_cert_reqs": "required",
            "ssl_ca_certs": self.ca_certs,
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_check_hostname": self.check_hostname,
            **({"connection_class": PinnedSSLConnection} if sync else {}),
        }

    def check_files(self) -> None:
        """A ValueError naming the first of its files that cannot be read: a client handed one
        would retry its handshakes for ever, saying only "No such file or directory"."""
        for path in (self.ca_certs, self.certfile, self.keyfile):
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"the cluster URL's certificate file {path} cannot be read")

    def query(self) -> str:
        """This, as a URL's query (``?ssl_ca_certs=...``), or "" if it sets nothing."""
        pairs = [("ssl_ca_certs", self.ca_certs), ("ssl_certfile", self.certfile), ("ssl_keyfile", self.keyfile)]
        pairs += [] if self.check_hostname else [("ssl_check_hostname", "false")]
        text = "&".join(f"{name}={quote(value, safe='/')}" for name, value in pairs if value)
        return f"?{text}" if text else ""


@dataclass(frozen=True)
class ClusterUrl:
    """``redis+cluster://[user[:password]@]host:port[,host:port...][/0]``, parsed; or
    ``rediss+cluster://...[?ssl_ca_certs=FILE&ssl_certfile=FILE&ssl_keyfile=FILE]``: TLS to
    every node (:class:`ClusterTls`)."""

    nodes: tuple[tuple[str, int], ...]
    """Startup nodes (host without brackets, port): any one that answers is enough for the
    client to read the slot map and find every other node."""
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    """Never in ``repr``: a parsed URL may end up in a log line or a traceback."""
    tls: ClusterTls | None = None
    """None: plain TCP (``redis+cluster://``), the password and every prompt in clear."""

    def client_settings(self, sync: bool = False) -> dict[str, Any]:
        """Username, password and TLS as a cluster client's keyword arguments (``sync``: for a
        ``redis.RedisCluster``, see :meth:`ClusterTls.settings`); a certificate file that cannot
        be read is a ValueError naming it (:meth:`ClusterTls.check_files`)."""
        if self.tls:
            self.tls.check_files()
        tls = self.tls.settings(sync) if self.tls else {}
        return {"username": self.username, "password": self.password, **tls}


def cluster_url(user: str, password: str, nodes: list[tuple[str, int]], tls: ClusterTls | None = None) -> str:
    """The URL of a cluster's ``nodes`` as ``user`` (``rediss+cluster://`` with ``tls``)."""
    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in nodes)
    scheme = SCHEME if tls is None else TLS_SCHEME
    query = tls.query() if tls is not None else ""
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{hosts}{query}"


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (else it is a redis-py URL for one server)."""
    return _scheme(url) in (SCHEME, TLS_SCHEME)


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url[: len(TLS_SCHEME) + 3] else ""


def parse_cluster_url(url: str) -> ClusterUrl:
    """Read a cluster URL; ValueError (whose text never holds the password) if it is not one."""
    if not is_cluster_url(url):
        raise ValueError(f"not a {SCHEME}:// or {TLS_SCHEME}:// URL")
    scheme = _scheme(url)
    userinfo, _, location = url[len(scheme) + 3 :].rpartition("@")
    location, _, query = location.partition("?")
    hosts, _, path = location.partition("/")
    if path not in ("", "0") or "#" in location + query:
        raise ValueError(f"a {scheme} URL takes no path but /0: a cluster has one database")
    if query and scheme == SCHEME:
        raise ValueError(f"a {SCHEME} URL takes no query; TLS options go in a {TLS_SCHEME} URL")
    user, has_password, password = userinfo.partition(":")
    return ClusterUrl(
        nodes=_nodes(hosts),
        username=unquote(user) or None,
        password=unquote(password) if has_password and password else None,
        tls=_tls(query) if scheme == TLS_SCHEME else None,
    )


def _tls(query: str) -> ClusterTls:
    """A ``rediss+cluster`` URL's query; an option it does not know is refused, not ignored
    (a misspelt ``ssl_ca_certs`` would silently trust the system's CAs instead)."""
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, max_num_fields=len(TLS_OPTIONS) + 1):
        if name not in TLS_OPTIONS or name in options or not value:
            raise ValueError(f"a {TLS_SCHEME} URL takes each of {', '.join(TLS_OPTIONS)} once, with a value")
        options[name] = value
    if "ssl_keyfile" in options and "ssl_certfile" not in options:
        raise ValueError("ssl_keyfile in a cluster URL needs ssl_certfile (the certificate it is the key of)")
    check = options.get("ssl_check_hostname", "true").lower()
    if check not in _BOOLEANS:
        raise ValueError("ssl_check_hostname in a cluster URL is true or false")
    if not _BOOLEANS[check] and "ssl_ca_certs" not in options:
        # Unchecked names against the system's CAs: any public certificate, for any name, would pass.
        raise ValueError("ssl_check_hostname=false in a cluster URL needs ssl_ca_certs (a CA of the cluster's own)")
    return ClusterTls(
        options.get("ssl_ca_certs"), options.get("ssl_certfile"), options.get("ssl_keyfile"), _BOOLEANS[check]
    )


def _nodes(hosts: str) -> tuple[tuple[str, int], ...]:
    parts = [part.strip() for part in hosts.split(",")]
    if not hosts or any(not part for part in parts):
        raise ValueError(f"a {SCHEME} URL needs host:port[,host:port...] after its user and password")
    if len(parts) > MAX_NODES:
        raise ValueError(f"a {SCHEME} URL names at most {MAX_NODES} nodes (got {len(parts)})")
    return tuple(_node(part) for part in parts)


def _node(text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not colon:
        host, port = text, str(DEFAULT_PORT)
    if not _HOST.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port in a {SCHEME} URL: {text!r}")
    return host.strip("[]"), int(port)


class BusCluster(aioredis.RedisCluster):
    """redis-py 8's asyncio cluster client, but on the single-Redis client's connections, and for
    two things it does unlike the single-Redis client under concurrency.

    **The bus's connections.** Every node's connections are the single-Redis client's,
    :class:`~splitbus.bus.core.wire.BusConnection` (``BusSSLConnection`` on TLS): a write to a
    transport closed under it is a ``ConnectionError``, and a cancel that meets a write's end is
    not lost (redis-py alone: a cancelled task may run on). See :meth:`_guard_connections`.

    **A full node pool.** redis-py's cluster client has no blocking pool: a node's full pool
    raises ``MaxConnectionsError`` at once, and a pipeline that meets it (a ``ConnectionError``)
    closes every connection of the client before it retries, blocking reads of other tasks
    included (measured: 50 concurrent hand-offs on a worker's 16-connection client failed that
    way; a burst of the API's cancellations of 50 disconnected clients lost all but the pool's
    size of them). So commands and pipelines wait for one of ``max_connections`` places, as the
    single-Redis client waits for a connection of its blocking pool; each holds at most one
    connection per node at a time, so no node's pool fills. Should one fill all the same, a
    command waits up to ``pool_wait_s`` for a connection (nothing was sent: sending again is safe).

    **Dropping connections after a node fails.** redis-py calls :meth:`aclose` itself when a
    pipeline meets a ``ConnectionError`` (before it retries) and on ``CLUSTERDOWN``: that
    disconnects every connection to every node, including those other tasks are using at that
    moment, which then fail with ``AttributeError`` or ``RuntimeError`` (a closed transport), not
    a ``ConnectionError`` the bus would back off on (measured in tests/faults/test_cluster_failover.py:
    a kill -9 of a result stream's primary failed KV hand-offs on the live control-plane primary).
    Here connections in use are only marked, and closed when their command is done (redis-py's own
    path for a node that failed), and the slot map is read again before the next command; with none
    in use, it closes as redis-py does."""

    pool_wait_s: float = 5.0
    """How long a command waits for a connection of a full node pool (a single Redis's blocking
    pool waits ``socket_timeout_s``, what :func:`~splitbus.bus.core.connection.connect` sets this to)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gate = asyncio.Semaphore(int(kwargs.get("max_connections", 100)))
        self._guard_connections()

    def _guard_connections(self) -> None:
        """Swap redis-py's connection class for the bus's, on every node this client has made or
        will make.

        redis-py 8.2's ``RedisCluster`` takes no connection class: its ``__init__`` puts
        ``Connection``, or ``SSLConnection`` with ``ssl=True``, in one dict of node settings, its
        ``connection_kwargs``, which it hands to its ``NodesManager`` (the same dict, kept as the
        manager's ``connection_kwargs``). Every ``ClusterNode`` after ``__init__`` is built from
        the manager's dict: the slot map's nodes at each refresh, a MOVED's new node, a refresh's
        extra startup nodes, a pipeline's parser node; and a node opens its connections with the
        class it was built with. By the end of ``__init__`` only the startup nodes exist, none
        connected yet. So the class is set in that dict, through the client's name for it and the
        manager's (one dict in 8.2; both, should a later redis-py copy it), and on the startup
        nodes, once, here: no redis-py method is overridden (a private one, ``acquire_connection``
        or ``move_slot``, would be a hook per path, and one a release may rename), and a redis-py
        that picked another class fails here (``guarded``) rather than run unguarded."""
        settings = self.nodes_manager.connection_kwargs
        bus_class = guarded(settings["connection_class"])
        settings["connection_class"] = self.connection_kwargs["connection_class"] = bus_class
        for node in [*self.startup_nodes, *self.nodes_manager.startup_nodes.values()]:
            node.connection_class = bus_class

    async def execute_command(self, *args: EncodableT, **kwargs: Any) -> Any:
        async with self._gate:
            return await self._until_a_connection(*args, **kwargs)

    async def _until_a_connection(self, *args: EncodableT, **kwargs: Any) -> Any:
        deadline, delay = time.monotonic() + self.pool_wait_s, 0.002
        while True:
            try:
                return await super().execute_command(*args, **kwargs)
            except MaxConnectionsError:
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise ValueError("shard_hint is not supported in cluster mode")
        # redis-py's typing marks ``_event_dispatcher`` abstract on a base class; ClusterPipeline
        # sets it in __init__, and RedisCluster.pipeline() makes its own the same way.
        return _GatedPipeline(self, transaction)  # type: ignore[abstract]

    @property
    def gate(self) -> asyncio.Semaphore:
        """The places: one per command or pipeline in flight."""
        return self._gate

    async def aclose(self) -> None:
        nodes = list(self.nodes_manager.nodes_cache.values())
        if not any(set(node._connections) - set(node._free) for node in nodes):
            await super().aclose()
            return
        self._initialize = True  # the next command reads the slot map again first
        for node in nodes:
            node.update_active_connections_for_reconnect()
            await node.disconnect_free_connections()


class _GatedPipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        client = self.cluster_client
        assert isinstance(client, BusCluster)
        async with client.gate:
            return await super().execute(raise_on_error, allow_redirections)


def as_cluster(redis: aioredis.Redis) -> aioredis.RedisCluster | None:
    """The client as a cluster client if it is one (``connect`` gave it for a cluster URL)."""
    return redis if isinstance(redis, aioredis.RedisCluster) else None


def _target(cluster: aioredis.RedisCluster, key: KeyT) -> dict[str, Any]:
    """``target_nodes`` for a command on ``key``'s slot: its primary in the client's slot map,
    looked up at each call, so once redis-py has read the map again (after a MOVED, or a
    connection error on a node that failed over) the next call goes to the new primary. An
    uncovered slot: no target, redis-py routes (and raises) as it would."""
    name = key.decode() if isinstance(key, bytes) else str(key)
    try:
        return {"target_nodes": cluster.get_node_from_key(name)}
    except SlotNotCoveredError:
        return {}


async def xread(
    redis: aioredis.Redis, streams: Mapping[str, str] | Mapping[KeyT, StreamIdT], count: int, block: int | None
) -> Any:
    """``XREAD COUNT count [BLOCK block] STREAMS ...`` (no BLOCK for None; at least 1 ms, since
    Redis reads ``BLOCK 0`` as "wait forever"); on a cluster sent to the primary of the streams'
    slot (they must share one: the server answers CROSSSLOT otherwise). The reply is as the
    client's response callback makes it. Callers follow streams through ``splitbus.bus.core.follow``."""
    blocking = ("BLOCK", max(block, 1)) if block is not None else ()
    args = ("COUNT", count, *blocking, "STREAMS", *streams.keys(), *streams.values())
    cluster = as_cluster(redis)
    if cluster is None:
        return await redis.execute_command("XREAD", *args)
    return await cluster.execute_command("XREAD", *args, **_target(cluster, next(iter(streams))))


async def xreadgroup(
    redis: aioredis.Redis, group: str, consumer: str, stream: str, cursor: str, count: int, block: int | None
) -> Any:
    """``XREADGROUP`` of one stream, on a cluster sent to the primary of its slot."""
    cluster = as_cluster(redis)
    if cluster is None:
        return await redis.xreadgroup(group, consumer, {stream: cursor}, count=count, block=block)
    blocking = ("BLOCK", block) if block is not None else ()
    args = ("GROUP", group, consumer, "COUNT", count, *blocking, "STREAMS", stream, cursor)
    return await cluster.execute_command("XREADGROUP", *args, **_target(cluster, stream))


TAG_TRIES = 4096
"""Suffixes :meth:`SlotMap.tag_on` tries before it gives up: a primary serving a share ``f`` of
the slots is missed ``(1 - f)^4096`` of the time (``f`` = 1/16: never, in practice)."""


@dataclass(frozen=True)
class SlotMap:
    """Which primary serves each hash slot, the primaries numbered in slot order (the one that
    serves the lowest slot is 0): every process that reads the same map numbers them alike."""

    owners: tuple[int, ...]
    """Per slot, the number of its primary; -1 where no primary serves it."""
    primaries: int
    """Primaries that serve at least one slot."""

    @classmethod
    def of(cls, slots: dict[int, list[Any]]) -> SlotMap:
        """From redis-py's ``slots_cache`` (slot -> its nodes, the primary first)."""
        first: dict[str, int] = {}
        for slot in sorted(slots):
            if slots[slot]:
                first.setdefault(slots[slot][0].name, slot)
        number = {name: i for i, name in enumerate(sorted(first, key=first.__getitem__))}
        owners = tuple(number[slots[s][0].name] if slots.get(s) else -1 for s in range(REDIS_CLUSTER_HASH_SLOTS))
        return cls(owners, len(number))

    def owner(self, tag: str) -> int:
        """The primary that serves the keys tagged ``{tag}`` (a tag has no braces, so its slot is
        the CRC16 of the tag itself, what ``key_slot`` computes of it)."""
        return self.owners[key_slot(tag.encode())]

    def tag_on(self, name: str, primary: int) -> str:
        """The first of ``name``, ``name-1``, ``name-2``, ... whose slot ``primary`` serves (about
        ``primaries`` tries); ``name`` itself if none of TAG_TRIES is (a primary left with few
        slots: the tag is then hashed as it would be without a map)."""
        for j in range(TAG_TRIES):
            tag = f"{name}-{j}" if j else name
            if self.owner(tag) == primary:
                return tag
        return name


async def slot_map(redis: aioredis.Redis) -> SlotMap | None:
    """The cluster's slot map as the client holds it (read from the cluster first if the client
    has not yet); None on a single Redis."""
    cluster = as_cluster(redis)
    if cluster is None:
        return None
    await cluster.initialize()
    return SlotMap.of(cluster.nodes_manager.slots_cache)
