"""``splitbus up``: the whole system as child processes.

This build has the bus and the API but no workers yet: ``up`` starts the embedded Redis (or checks
``--redis-url``) and says which parts are missing. The scheduler, workers and API join here.
"""

from __future__ import annotations

import argparse

import redis

from splitbus.cli.common import say, wait_for_stop
from splitbus.cli.redis_cmd import add_embedded_options, start_embedded
from splitbus.env import Env
from splitbus.redis_server import RedisServerError, find_redis_cli

NOT_YET_BUILT = ("scheduler", "prefill/decode workers")


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("up", help="run the whole system (embedded Redis unless --redis-url)")
    p.add_argument("--redis-url", default=env.redis_url, help="use this Redis instead of starting one")
    p.add_argument("--engine", choices=("paddle", "sim"), default="paddle")
    p.add_argument("--model", default=None, help="Hugging Face model folder (paddle engine)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default %(default)s)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default %(default)s)")
    p.add_argument("--mixed", type=int, default=0, help="mixed workers (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="API address (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="API port (default %(default)s)")
    p.add_argument("--api-key", action="append", default=list(env.api_keys), help="accepted Bearer key")
    add_embedded_options(p, env)
    p.set_defaults(run=run)


def run(args: argparse.Namespace, env: Env) -> int:
    if args.redis_url:
        return _check_external(args.redis_url)
    try:
        server = start_embedded(args)
    except RedisServerError as exc:
        say(f"splitbus up: {exc}")
        return 1
    try:
        say(f"Redis ready at {server.url} (embedded, data in {server.data_dir})")
        say(f"  follow it: {find_redis_cli(server.executable)} -u {server.url}")
        say(f"Not in this build yet: {', '.join(NOT_YET_BUILT)}. Only Redis is running")
        say("(`splitbus api` exists, but has nothing to serve without workers).")
        say("Ctrl-C stops everything.")
        why = wait_for_stop(lambda: None if server.alive() else "redis-server exited")
    finally:
        server.stop()
    say(f"stopped ({why})")
    return 0 if why in ("SIGINT", "SIGTERM") else 1


def _check_external(url: str) -> int:
    try:
        redis.Redis.from_url(url, socket_timeout=3).ping()
    except (redis.RedisError, OSError) as exc:
        say(f"splitbus up: Redis at {url} is not reachable: {exc}")
        return 1
    say(f"Redis at {url} answers. Not in this build yet: {', '.join(NOT_YET_BUILT)}; nothing to start.")
    return 0
