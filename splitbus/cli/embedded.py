"""The embedded Redis or Redis Cluster of a data folder, as ``status``, ``redis-cli`` and the
parts find it, and the ``redis+cluster://`` URL a cluster is named by (parsed by the bus:
``splitbus.bus.core.cluster``; re-exported here for the CLI).

``splitbus up`` keeps the single embedded Redis in ``<data dir>/redis/`` and, with
``--redis-cluster N``, the embedded cluster in ``<data dir>/redis-cluster/`` (docs/cluster.md).
A tool given neither ``--redis-url`` nor ``SPLITBUS_REDIS_URL`` uses the one of the two started
last (its redis.conf is written at each start).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import redis

from splitbus.bus.core.cluster import ClusterUrl as ClusterUrl  # re-exported for the CLI
from splitbus.bus.core.cluster import cluster_url as cluster_url
from splitbus.bus.core.cluster import is_cluster_url, parse_cluster_url
from splitbus.cluster_tls import TlsFiles
from splitbus.redis_cluster import TLS_FOLDER, client_port, client_tls
from splitbus.redis_server import ADMIN_USER, SPLITBUS_USER, embedded_url, read_secret

SINGLE_FOLDER = "redis"
CLUSTER_FOLDER = "redis-cluster"
_BIND = re.compile(r"^bind (\S+)", re.MULTILINE)
_TLS = re.compile(r"^tls-port \d+", re.MULTILINE)
_NODE = re.compile(r"node-(\d+)")

SyncClient = redis.Redis | redis.RedisCluster
"""What ``status`` reads with: a client of one Redis or of a cluster (the same commands)."""


def sync_client(url: str, **kwargs: Any) -> SyncClient:
    """A client for ``url``: a ``RedisCluster`` for a cluster URL (it connects at once, and
    raises ``RedisClusterException`` if no node answers), else ``Redis.from_url``."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **kwargs)
    from redis.cluster import ClusterNode

    parsed = parse_cluster_url(url)
    nodes = [ClusterNode(host, port) for host, port in parsed.nodes]
    return redis.RedisCluster(startup_nodes=nodes, **parsed.client_settings(sync=True), **kwargs)


def embedded_cluster_url(folder: Path, admin: bool = False) -> str | None:
    """The URL of the embedded cluster last started in ``folder`` (None if there never was
    one): every node's host and port from its redis.conf, the password from its file, and on a
    TLS cluster (``rediss+cluster://``) the CA and client certificate of its ``tls/`` folder."""
    confs = sorted(Path(folder).glob("node-*/redis.conf"), key=_node_index)
    user, name = (ADMIN_USER, "admin.password") if admin else (SPLITBUS_USER, "splitbus.password")
    try:
        password = read_secret(Path(folder) / name)
        texts = [conf.read_text() for conf in confs]
    except OSError:
        return None
    found = [node for node in map(_address, texts) if node is not None]
    tls = client_tls(TlsFiles(Path(folder) / TLS_FOLDER)) if any(_TLS.search(text) for text in texts) else None
    return cluster_url(user, password, found, tls) if found else None


def _node_index(conf: Path) -> int:
    match = _NODE.fullmatch(conf.parent.name)
    return int(match.group(1)) if match else -1


def _address(conf: str) -> tuple[str, int] | None:
    host, port = _BIND.search(conf), client_port(conf)
    return (host.group(1), port) if host and port else None


def embedded_bus_url(data_dir: Path, admin: bool = False) -> str | None:
    """The URL of the embedded Redis or cluster started last in ``data_dir`` (None if neither
    ever was)."""
    single = Path(data_dir) / SINGLE_FOLDER
    cluster = Path(data_dir) / CLUSTER_FOLDER
    if _started_at(cluster / "node-0") > _started_at(single):
        return embedded_cluster_url(cluster, admin) or embedded_url(single, admin)
    return embedded_url(single, admin) or embedded_cluster_url(cluster, admin)


def _started_at(folder: Path) -> float:
    """When the server of ``folder`` last started (its redis.conf's mtime); -1 if never."""
    try:
        return (folder / "redis.conf").stat().st_mtime
    except OSError:
        return -1.0
