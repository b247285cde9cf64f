"""The embedded Redis Cluster: ``primaries`` redis-server children on loopback, each with
``replicas`` replicas, joined by hand with redis-py (``CLUSTER MEET``, ``ADDSLOTS``,
``REPLICATE``): no ``redis-cli --cluster`` child, so no password on any command line.

Every node is an :class:`~splitbus.redis_server.EmbeddedRedis` in its own folder
(``node-<i>/``: its redis.conf, AOF, log and the ``nodes.conf`` Redis keeps), locked down as the
single embedded Redis is, with the cluster's one pair of passwords (kept once, in the cluster's
folder) and, on top of its ACL rules, what a cluster client needs (:data:`CLUSTER_CLIENT_COMMANDS`)
and a ``replicator`` user that may only replicate. Replicas log in as that user: its password is
set at each start with ``CONFIG SET masterauth`` (every node, since any may become a replica
after a failover), never written to a file in clear.

TLS (the default): every node serves TLS only (``port 0``, ``tls-port``), on its cluster bus and
replication links too, and takes a connection only from a peer with a certificate of the
cluster's own CA (``tls-auth-clients yes``; :mod:`splitbus.cluster_tls` makes them in ``tls/``).
Without it, anyone who can reach a node's bus port (its port + 10000) can ``CLUSTER MEET`` a node
of their own into the cluster, give it a slot, and collect the password of the next client that
follows ``MOVED`` there. ``tls=False`` (``up --insecure-cluster-bus``) runs plain TCP, for a
redis-server built without TLS on a host where nobody else runs anything.

Started again on a folder it ran in, the cluster comes back as it was (the nodes keep their ports
and ``nodes.conf``) instead of being built anew. See docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import random
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.cluster import ClusterNode
from redis.crc import key_slot

from splitbus.bus.core.cluster import ClusterTls, cluster_url
from splitbus.bus.core.wire import PinnedSSLConnection
from splitbus.cluster_tls import TlsFiles, ensure_tls_files
from splitbus.redis_server import (
    ADMIN_USER,
    SPLITBUS_USER,
    TLS_PACKAGE_HINT,
    EmbeddedRedis,
    RedisServerError,
    acl_rule,
    commands_for,
    ensure_secret,
    find_tls_redis_server,
    make_private_folder,
    read_secret,
    supports_tls,
)

SLOTS = 16384
"""Hash slots of a Redis Cluster."""
BUS_PORT_OFFSET = 10000
"""Redis 6.2 puts a node's cluster bus on its port + 10000 (``cluster-port`` came in 7.0)."""
DEFAULT_NODE_TIMEOUT_MS = 1000
"""``cluster-node-timeout``: how long a primary may be unreachable before its replica takes over
(Redis's default, 15000, is a 15 s outage per failover)."""
CLUSTER_CLIENT_COMMANDS = (
    "cluster|slots",  # redis-py reads the slot map at start, after a MOVED and after a node fails
    "cluster|shards",  # Redis 7's successor of SLOTS
    "command",  # redis-py reads COMMAND per topology load, and routes XREAD/XREADGROUP by COMMAND GETKEYS
    "asking",  # sent before a command that an ASK redirection (a slot migrating) points elsewhere
    "readonly",  # a client that reads from replicas
    "readwrite",
)
"""What the ``splitbus`` user may run on a cluster node besides :data:`SPLITBUS_COMMANDS`."""
REPLICATION_USER = "replicator"
REPLICATION_COMMANDS = ("psync", "replconf", "ping")
"""What a replica runs on its primary (Redis's documented minimum for ``masteruser``)."""
_PORT = re.compile(r"^port (\d+)", re.MULTILINE)
_TLS_PORT = re.compile(r"^tls-port (\d+)", re.MULTILINE)
TLS_FOLDER = "tls"
"""The cluster's certificates, in its folder (:mod:`splitbus.cluster_tls`)."""


def client_port(conf: str) -> int | None:
    """The port clients dial, from a node's redis.conf: ``tls-port`` on a TLS node (its
    ``port`` is 0), else ``port``."""
    match = _TLS_PORT.search(conf) or _PORT.search(conf)
    return int(match.group(1)) if match and int(match.group(1)) else None


def tls_config(files: TlsFiles, port: int) -> dict[str, str]:
    """redis.conf lines for a node that speaks TLS only, to clients and to the other nodes, and
    takes only peers whose certificate the cluster's CA signed."""
    return {
        "port": "0",  # no plain TCP listener at all
        "tls-port": str(port),
        "tls-cert-file": _quoted(files.node_cert),
        "tls-key-file": _quoted(files.node_key),
        "tls-ca-cert-file": _quoted(files.ca_cert),
        "tls-auth-clients": "yes",
        "tls-cluster": "yes",  # the cluster bus (port + 10000): MEET, gossip, failover votes
        "tls-replication": "yes",
    }


def client_tls(files: TlsFiles) -> ClusterTls:
    """What a client of the cluster verifies the nodes with and shows them."""
    return ClusterTls(str(files.ca_cert.resolve()), str(files.client_cert.resolve()), str(files.client_key.resolve()))


def _quoted(path: Path) -> str:
    """A path as a redis.conf value (a double-quoted string: a folder name may hold a space)."""
    text = str(path.resolve()).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


class ClusterNodeServer(EmbeddedRedis):
    """One node: an :class:`EmbeddedRedis` in cluster mode, with the cluster's passwords."""

    def __init__(
        self,
        data_dir: Path,
        secrets_dir: Path,
        port: int,
        node_timeout_ms: int,
        host: str = "127.0.0.1",
        appendonly: bool = True,
        executable: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        """``tls``: TLS only, with these certificates (:func:`tls_config`); None: plain TCP."""
        config = {
            "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf",  # in the node's folder (``dir``)
            "cluster-node-timeout": str(node_timeout_ms),
            # Keys of the other primaries' slots stay served while one primary fails over.
            "cluster-require-full-coverage": "no",
            **(tls_config(tls, port) if tls else {}),
        }
        super().__init__(data_dir, host, port, appendonly, executable, extra_config=config)
        self.tls = tls
        self.secrets_dir = secrets_dir
        self._admin: redis.Redis | None = None

    @property
    def password_path(self) -> Path:
        return self.secrets_dir / "splitbus.password"

    @property
    def admin_password_path(self) -> Path:
        return self.secrets_dir / "admin.password"

    @property
    def replication_password_path(self) -> Path:
        return self.secrets_dir / "replication.password"

    def acl_lines(self, version: tuple[int, int, int]) -> list[str]:
        commands = commands_for(version) + CLUSTER_CLIENT_COMMANDS
        replication = ensure_secret(self.replication_password_path)
        return [
            acl_rule(ADMIN_USER, self._passwords[ADMIN_USER], None),
            acl_rule(SPLITBUS_USER, self._passwords[SPLITBUS_USER], commands),
            acl_rule(REPLICATION_USER, replication, REPLICATION_COMMANDS),
        ]

    def _url(self, user: str) -> str:
        """``rediss://`` with the client certificate and the CA on a TLS node."""
        url = super()._url(user)
        return url if self.tls is None else "rediss" + url.removeprefix("redis") + client_tls(self.tls).query()

    def start(self, timeout_s: float = 10.0, wait: bool = True) -> str:
        url = super().start(timeout_s, wait)
        self.admin().config_set("masteruser", REPLICATION_USER)  # in memory only: no clear password in a file
        self.admin().config_set("masterauth", ensure_secret(self.replication_password_path))
        return url

    def kill(self) -> None:
        """SIGKILL, as a crash: no AOF flush, no goodbye to the other nodes."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
        self.stop()

    def admin_client(self, **kwargs: object) -> redis.Redis:
        """As the single Redis's, on a TLS node trusting the cluster's CA alone (a listener on a
        dead node's port, with any other certificate, gets no admin password)."""
        if self.tls is not None:
            kwargs.setdefault("connection_class", PinnedSSLConnection)
        return super().admin_client(**kwargs)

    def admin(self) -> redis.Redis:
        """The node's admin client (one, kept until :meth:`stop`: health checks poll it)."""
        if self._admin is None:
            self._admin = self.admin_client(socket_timeout=2, socket_connect_timeout=1, decode_responses=True)
        return self._admin

    def cluster(self, *args: str) -> str:
        """A ``CLUSTER`` subcommand's reply as text (admin user)."""
        reply = self.admin().execute_command("CLUSTER", *args)
        return reply if isinstance(reply, str) else str(reply)

    def stop(self, timeout_s: float = 10.0) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            admin.close()
        super().stop(timeout_s)


@dataclass(frozen=True)
class NodeView:
    """One line of ``CLUSTER NODES``, as the node that printed it sees the node it names."""

    node_id: str
    port: int
    flags: frozenset[str]
    """``myself``, ``master``, ``slave``, ``fail``, ``fail?``, ``handshake``, ``noaddr``..."""
    primary_id: str
    """The id of the primary it replicates ("" for a primary)."""
    slots: tuple[tuple[int, int], ...]
    """The slot ranges it serves, ``(low, high)``."""

    @property
    def slot_count(self) -> int:
        return sum(high - low + 1 for low, high in self.slots)

    def serves(self, slot: int) -> bool:
        return any(low <= slot <= high for low, high in self.slots)

    @property
    def primary(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})


def parse_nodes(text: str) -> list[NodeView]:
    """``CLUSTER NODES`` as rows: ``<id> <ip:port@bus> <flags> <primary|-> <ping> <pong> <epoch>
    <link> <slot ranges...>``."""
    rows = []
    for line in text.strip().splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        port = int(fields[1].split("@", 1)[0].rsplit(":", 1)[1] or 0)
        primary = "" if fields[3] == "-" else fields[3]
        rows.append(NodeView(fields[0], port, frozenset(fields[2].split(",")), primary, _ranges(fields[8:])))
    return rows


def _ranges(items: list[str]) -> tuple[tuple[int, int], ...]:
    """``0-5460``, ``7`` as ranges; ``[slot->-id]`` (a slot migrating) is not served yet."""
    ranges = []
    for item in items:
        if not item.startswith("["):
            low, _, high = item.partition("-")
            ranges.append((int(low), int(high or low)))
    return tuple(ranges)


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """Primary ``i``'s slots, ``(low, high)``: equal shares, rounded as ``redis-cli --cluster
    create`` rounds them (0-5460, 5461-10922, 10923-16383 for three)."""
    share = SLOTS / primaries
    highs = [min(SLOTS - 1, int(share * (i + 1) - 1 + 0.5)) for i in range(primaries - 1)] + [SLOTS - 1]
    return [(0 if i == 0 else highs[i - 1] + 1, high) for i, high in enumerate(highs)]


def free_cluster_port(host: str, taken: set[int], attempts: int = 200) -> int:
    """A port that is free on ``host`` and whose bus port (+10000) is free too, both below the
    kernel's ephemeral range where it leaves room: a cluster restarted from its folder needs
    its old ports again, and an outgoing connection may hold a port of that range (measured:
    ``up --redis-cluster`` restarted on its folder found a node's old port in use)."""
    low, high = _PORT_FLOOR, min(_ephemeral_start(), 65536) - 1 - BUS_PORT_OFFSET
    if high - low < 1000:
        low, high = 20000, 65535 - BUS_PORT_OFFSET
    for _ in range(attempts):
        port = random.randint(low, high)
        if port in taken or port + BUS_PORT_OFFSET in taken:
            continue
        if _bindable(host, port) and _bindable(host, port + BUS_PORT_OFFSET):
            return port
    raise RedisServerError(f"found no free port pair (port, port + {BUS_PORT_OFFSET}) on {host}")


_PORT_FLOOR = 10000
"""Cluster ports start here (below: well-known and registered services, more often in use)."""


def _ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections (Linux; else 32768)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _saved_port(node_dir: Path) -> int | None:
    """The port a node ran on before (its redis.conf), so a restarted cluster finds itself."""
    with contextlib.suppress(OSError):
        return client_port((node_dir / "redis.conf").read_text())
    return None


class EmbeddedCluster:
    """Start with :meth:`start` (or ``with``): ``primaries`` nodes that share the slots and
    ``replicas`` replicas of each. :attr:`startup_nodes` and :attr:`password` are what a cluster
    client needs (``splitbus`` user); :meth:`client` builds one. ``tls`` (the default): TLS on
    every port, certificates made in the folder (see the module's text); it needs a redis-server
    built with TLS (RedisServerError at :meth:`start` if there is none)."""

    def __init__(
        self,
        data_dir: Path,
        primaries: int = 3,
        replicas: int = 1,
        host: str = "127.0.0.1",
        node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS,
        appendonly: bool = True,
        executable: str | None = None,
        tls: bool = True,
    ) -> None:
        if not 1 <= primaries <= 64 or not 0 <= replicas <= 4:
            raise RedisServerError(f"need 1-64 primaries and 0-4 replicas each, got {primaries} and {replicas}")
        if node_timeout_ms < 100:
            raise RedisServerError(f"cluster-node-timeout must be >= 100 ms, got {node_timeout_ms}")
        self.data_dir = Path(data_dir)
        self.primaries, self.replicas = primaries, replicas
        self.host = host
        self.node_timeout_ms = node_timeout_ms
        self.appendonly = appendonly
        self.executable = executable
        self.tls = tls
        self.tls_files: TlsFiles | None = None
        """The certificates, once :meth:`start` made or found them (None on a plain cluster)."""
        self.nodes: list[ClusterNodeServer] = []

    @property
    def size(self) -> int:
        return self.primaries * (1 + self.replicas)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node: any one is enough for a client to find the others."""
        return [(node.host, int(node.port or 0)) for node in self.nodes]

    @property
    def password(self) -> str:
        """The ``splitbus`` user's password (the same on every node)."""
        return read_secret(self.data_dir / "splitbus.password")

    @property
    def admin_password(self) -> str:
        return read_secret(self.data_dir / "admin.password")

    @property
    def client_tls(self) -> ClusterTls | None:
        """The CA and client certificate a client needs (None on a plain cluster)."""
        return client_tls(self.tls_files) if self.tls_files else None

    @property
    def url(self) -> str:
        """``rediss+cluster://splitbus:<password>@host:port,...?ssl_ca_certs=...&ssl_certfile=...
        &ssl_keyfile=...`` (``redis+cluster://`` without TLS): every node as a startup node (the
        form docs/cluster.md proposes for ``SPLITBUS_REDIS_URL``)."""
        return cluster_url(SPLITBUS_USER, self.password, self.startup_nodes, self.client_tls)

    def client(self, admin: bool = False, **kwargs: Any) -> redis.RedisCluster:
        """A sync cluster client as the ``splitbus`` user (``admin``: the ``default`` user)."""
        user, password = (ADMIN_USER, self.admin_password) if admin else (SPLITBUS_USER, self.password)
        nodes = [ClusterNode(host, port) for host, port in self.startup_nodes]
        tls = self.client_tls.settings(sync=True) if self.client_tls else {}
        return redis.RedisCluster(startup_nodes=nodes, username=user, password=password, **tls, **kwargs)

    def __enter__(self) -> EmbeddedCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 30.0, progress: Callable[[str], None] | None = None) -> str:
        """Start every node, join them into a cluster (unless they were one already: a restart),
        and wait until it is healthy (:meth:`problems` is empty). Returns :attr:`url`.
        ``progress`` is told each step, and what is still missing about once a second."""
        deadline = time.monotonic() + timeout_s
        tell = progress or (lambda _: None)
        make_private_folder(self.data_dir)
        ensure_secret(self.data_dir / "splitbus.password")
        ensure_secret(self.data_dir / "admin.password")
        if self.tls:
            self.executable = self.executable or find_tls_redis_server()
            if not supports_tls(self.executable):  # one given: say what is missing, not a node's config error
                raise RedisServerError(f"{self.executable} was not built with TLS: {TLS_PACKAGE_HINT}")
            self.tls_files = ensure_tls_files(self.data_dir / TLS_FOLDER, self.host)
        try:
            restart = self._make_nodes()
            for node in self.nodes:
                node.start(timeout_s=max(1.0, deadline - time.monotonic()))
            tell(f"{self.size} nodes running" + (", as the cluster they were in (restart)" if restart else ""))
            if not restart:
                self._create(deadline)
                tell(f"slots assigned to {self.primaries} primaries, nodes met, replicas following")
            self.wait_healthy(max(0.0, deadline - time.monotonic()), progress)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _make_nodes(self) -> bool:
        """One server per node, on its earlier port if it ran before; whether all of them had."""
        folders = [self.data_dir / f"node-{i}" for i in range(self.size)]
        saved = [_saved_port(folder) if (folder / "nodes.conf").exists() else None for folder in folders]
        taken = {port for port in saved if port is not None}
        ports = []
        for port in saved:
            ports.append(port if port is not None else free_cluster_port(self.host, taken))
            taken |= {ports[-1], ports[-1] + BUS_PORT_OFFSET}
        self.nodes = [self._node(folder, port) for folder, port in zip(folders, ports, strict=True)]
        return all(port is not None for port in saved)

    def _node(self, folder: Path, port: int) -> ClusterNodeServer:
        return ClusterNodeServer(
            folder,
            self.data_dir,
            port,
            self.node_timeout_ms,
            host=self.host,
            appendonly=self.appendonly,
            executable=self.executable,
            tls=self.tls_files,
        )

    def _create(self, deadline: float) -> None:
        """Epochs, slots and meetings on the primaries, then each replica follows its primary
        once it knows it (``CLUSTER REPLICATE`` needs the primary in its node table)."""
        primaries = self.nodes[: self.primaries]
        for epoch, node in enumerate(primaries, start=1):
            node.cluster("SET-CONFIG-EPOCH", str(epoch))  # distinct epochs: no collision to resolve
        for node, (low, high) in zip(primaries, slot_ranges(self.primaries), strict=True):
            node.cluster("ADDSLOTS", *[str(slot) for slot in range(low, high + 1)])
        for node in self.nodes[1:]:
            self.nodes[0].cluster("MEET", node.host, str(node.port))
        self._wait(lambda: self._everyone_known(), deadline, "every node to know every other")
        ids = [node.cluster("MYID") for node in primaries]
        for i, node in enumerate(self.nodes[self.primaries :]):
            node.cluster("REPLICATE", ids[i % self.primaries])

    def _everyone_known(self) -> bool:
        for node in self.nodes:
            rows = parse_nodes(node.cluster("NODES"))
            if len(rows) < self.size or any(row.failed for row in rows):
                return False
        return True

    def _wait(self, done: Callable[[], bool], deadline: float, what: str) -> None:
        while True:
            with contextlib.suppress(redis.RedisError, OSError):
                if done():
                    return
            if time.monotonic() > deadline:
                raise RedisServerError(f"the cluster in {self.data_dir}: timed out waiting for {what}")
            time.sleep(0.02)

    def wait_healthy(self, timeout_s: float = 30.0, progress: Callable[[str], None] | None = None) -> None:
        """Until :meth:`problems` is empty (RedisServerError with the last problems if not);
        ``progress`` hears what is still missing, about once a second."""
        deadline = time.monotonic() + timeout_s
        told = time.monotonic()
        last: list[str] = []
        while True:
            last = self.problems()
            if not last:
                return
            if time.monotonic() > deadline:
                raise RedisServerError(f"the cluster in {self.data_dir} is not healthy: {'; '.join(last)}")
            if progress is not None and time.monotonic() - told >= 1.0:
                told = time.monotonic()
                progress("waiting for " + "; ".join(last[:3]) + ("; ..." if len(last) > 3 else ""))
            time.sleep(0.02)

    def problems(self) -> list[str]:
        """What keeps the cluster from being healthy (empty: it is): every running node says
        ``cluster_state:ok`` with every slot covered, ``primaries`` primaries serve the slots,
        and each has ``replicas`` replicas with their link up and no sync under way."""
        found: list[str] = []
        for i, node in enumerate(self.nodes):
            if node.alive():
                found += [f"node {i} ({node.port}): {p}" for p in _node_problems(node)]
        if found:
            return found
        return self._role_problems()

    def _role_problems(self) -> list[str]:
        """Roles as each running node sees itself (its own line of ``CLUSTER NODES``: a node
        knows at once that it was promoted or whom it follows; the others learn it by gossip)."""
        views = self._self_views()
        serving = [view for view in views.values() if view.primary and view.slot_count]
        if len(serving) != self.primaries:
            return [f"{len(serving)} primaries serve slots, not {self.primaries}"]
        if len(views) < self.size:  # a node is down: its primary is short of a replica, knowingly
            return []
        found = []
        for primary in serving:
            followers = [view for view in views.values() if view.primary_id == primary.node_id]
            if len(followers) != self.replicas:
                found.append(f"primary {primary.port} has {len(followers)} replicas, not {self.replicas}")
        return found

    def _self_views(self) -> dict[int, NodeView]:
        """Each running node's line about itself, by port."""
        views = {}
        for node in self.live_nodes():
            view = next(row for row in parse_nodes(node.cluster("NODES")) if "myself" in row.flags)
            views[view.port] = view
        return views

    def live_nodes(self) -> list[ClusterNodeServer]:
        nodes = [node for node in self.nodes if node.alive()]
        if not nodes:
            raise RedisServerError("no node of the cluster is running")
        return nodes

    def primary_of(self, key: str) -> ClusterNodeServer:
        """The running node that serves ``key``'s slot now (after a failover, the new primary)."""
        return self.primary_of_slot(key_slot(key.encode()))

    def replicas_of(self, primary: ClusterNodeServer) -> list[ClusterNodeServer]:
        """The running nodes that replicate ``primary``, as they see themselves."""
        primary_id = primary.cluster("MYID")
        ports = {port for port, view in self._self_views().items() if view.primary_id == primary_id}
        return [node for node in self.live_nodes() if node.port in ports]

    def begin_slot_move(self, slot: int, target: ClusterNodeServer) -> ClusterNodeServer:
        """Start moving ``slot`` to ``target`` (a reshard, for tests of ``MOVED`` and ``ASK``):
        the two primaries mark it importing and migrating. Returns the slot's primary now."""
        source = self.primary_of_slot(slot)
        target.cluster("SETSLOT", str(slot), "IMPORTING", source.cluster("MYID"))
        source.cluster("SETSLOT", str(slot), "MIGRATING", target.cluster("MYID"))
        return source

    def migrate_keys(self, source: ClusterNodeServer, target: ClusterNodeServer, keys: list[str]) -> None:
        """Move keys of a migrating slot (``MIGRATE``, as the admin): ``source`` answers ``ASK``
        for them from now on."""
        source.admin().migrate(target.host, int(target.port or 0), keys, 0, 5000, auth=self.admin_password)

    def end_slot_move(self, slot: int, target: ClusterNodeServer) -> None:
        """Give ``slot`` to ``target`` on every primary (``SETSLOT NODE``): others answer ``MOVED``."""
        target_id = target.cluster("MYID")
        primaries = {row.port for row in parse_nodes(target.cluster("NODES")) if row.primary and not row.failed}
        others = [node for node in self.live_nodes() if node.port in primaries and node is not target]
        for node in [target, *others]:  # the importing side first, as Redis's guide orders it
            node.cluster("SETSLOT", str(slot), "NODE", target_id)

    def primary_of_slot(self, slot: int) -> ClusterNodeServer:
        """The running node that serves ``slot`` now, by its own account (right after a failover
        the other nodes may not know yet)."""
        for port, view in self._self_views().items():
            if view.primary and view.serves(slot):
                return self._by_port(port)
        raise RedisServerError(f"no running primary serves slot {slot}")

    def _by_port(self, port: int) -> ClusterNodeServer:
        return next(node for node in self.nodes if node.port == port)

    def stop(self) -> None:
        """Stop every node (SIGTERM: each flushes its AOF), replicas first: a primary that goes
        first would see its replicas start a failover for nothing."""
        for node in reversed(self.nodes):
            node.stop()

    def logs(self) -> Iterator[tuple[int, str]]:
        """(node index, its log's tail): for a test's failure message."""
        for i, node in enumerate(self.nodes):
            yield i, node._log_tail()


def _node_problems(node: ClusterNodeServer) -> list[str]:
    try:
        info = dict(_pairs(node.cluster("INFO")))
        replication = node.admin().info("replication")
    except (redis.RedisError, OSError) as exc:
        return [f"unreachable ({exc})"]
    found = []
    if info.get("cluster_state") != "ok":
        found.append(f"cluster_state:{info.get('cluster_state')}")
    if info.get("cluster_slots_ok") != str(SLOTS):
        found.append(f"{info.get('cluster_slots_ok')} slots ok")
    if replication.get("role") == "slave" and (
        replication.get("master_link_status") != "up" or int(replication.get("master_sync_in_progress", 1))
    ):
        found.append("replica not in sync")
    return found


def _pairs(text: str) -> Iterator[tuple[str, str]]:
    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        if sep:
            yield key, value
