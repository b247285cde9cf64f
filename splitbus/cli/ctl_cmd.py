"""``splitbus ctl``: send one control command to a worker and print its reply."""

from __future__ import annotations

import argparse
import json
from typing import Any

from splitbus.cli.common import add_redis_url_argument, redis_url, say
from splitbus.env import Env
from splitbus.masking import mask_text


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser(
        "ctl", help="send a control command (get_payload, get_metrics, connect_rdma, drain) to a worker"
    )
    p.add_argument("worker", help="worker id (see splitbus status)")
    p.add_argument("cmd", help="get_payload, get_metrics, connect_rdma or drain")
    p.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a command argument, e.g. decode_worker=decode-0, timeout_s=60",
    )
    add_redis_url_argument(p)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the reply")
    p.set_defaults(run=run)


def parse_args(pairs: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs; a value that is JSON (a number, true, a list) is taken as such."""
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--arg takes KEY=VALUE, got {pair!r}")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    return args


def run(args: argparse.Namespace, env: Env) -> int:
    import asyncio

    from splitbus.bus.control import call
    from splitbus.bus.core.config import BusConfig
    from splitbus.bus.core.connection import TRANSIENT_ERRORS, connect

    async def send() -> Any:
        config = BusConfig(redis_url=redis_url(args, env), prefix=env.prefix, cell=env.cell)
        client = connect(config)
        try:
            return await call(client, config, args.worker, args.cmd, parse_args(args.arg), args.timeout)
        finally:
            await client.aclose()

    failures: tuple[type[BaseException], ...] = (ValueError, TimeoutError, *TRANSIENT_ERRORS)
    try:
        reply = asyncio.run(send())
    except failures as exc:
        say(f"splitbus ctl: {mask_text(str(exc))}")
        return 2
    if reply.ok and args.cmd == "get_metrics":
        say(reply.result["text"].rstrip("\n"))
    else:
        say(
            json.dumps({"ok": reply.ok, "worker": reply.worker, "result": reply.result, "error": reply.error}, indent=2)
        )
    return 0 if reply.ok else 1
