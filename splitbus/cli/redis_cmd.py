"""``splitbus redis``: only the embedded Redis, until Ctrl-C."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitbus.cli.common import say, wait_for_stop
from splitbus.env import Env
from splitbus.folders import create_private
from splitbus.masking import mask_url
from splitbus.redis_server import EmbeddedRedis, RedisServerError, find_redis_cli, redis_cli_hint


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("redis", help="run only the embedded Redis and print its URL")
    add_embedded_options(p, env)
    p.set_defaults(run=run)


def add_embedded_options(p: argparse.ArgumentParser, env: Env) -> None:
    p.add_argument(
        "--data-dir", type=Path, default=env.data_dir, help="folder for the AOF and the passwords (default %(default)s)"
    )
    p.add_argument("--redis-host", default="127.0.0.1", help="address to bind (default %(default)s)")
    p.add_argument("--redis-port", type=int, default=None, help="port (default: a free one)")
    p.add_argument(
        "--redis-maxmemory",
        default=None,
        metavar="SIZE",
        help="memory limit such as 512mb; past it writes fail with OOM, nothing is evicted (default: none)",
    )
    p.add_argument("--no-aof", action="store_true", help="no persistence")


def start_embedded(args: argparse.Namespace) -> EmbeddedRedis:
    create_private(args.data_dir)
    server = EmbeddedRedis(
        args.data_dir / "redis",
        host=args.redis_host,
        port=args.redis_port,
        appendonly=not args.no_aof,
        maxmemory=args.redis_maxmemory,
    )
    server.start()
    return server


def describe(server: EmbeddedRedis, label: str = "try", command: str = "PING") -> list[str]:
    """Where the server is and where its passwords are; never the passwords themselves."""
    assert server.port is not None
    cli = redis_cli_hint(find_redis_cli(server.executable), server.password_path, server.host, server.port)
    return [
        f"  password: {server.password_path} (user splitbus); admin: {server.admin_password_path} (user default)",
        f"  {label}: {cli} {command}",
    ]


def run(args: argparse.Namespace, env: Env) -> int:
    try:
        server = start_embedded(args)
    except RedisServerError as exc:
        say(f"splitbus redis: {exc}")
        return 1
    try:
        say(f"Redis ready at {mask_url(server.url)} (pid {server.pid}, data in {server.data_dir})")
        for line in describe(server):
            say(line)
        say("Ctrl-C stops it.")
        why = wait_for_stop(lambda: None if server.alive() else "redis-server exited")
    finally:
        server.stop()
    say(f"stopped ({why})")
    return 0 if why in ("SIGINT", "SIGTERM") else 1
