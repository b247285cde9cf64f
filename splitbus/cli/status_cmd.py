"""``splitbus status``: workers, streams, dead letters and P-D links, read from Redis.

Works on Redis 6.2 (no ``lag`` in XINFO GROUPS: shown as "-") and 7.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, cast

import redis
from redis.exceptions import RedisClusterException

from splitbus.bus.connection import connect_sync
from splitbus.cli.common import add_redis_url_argument, redis_url, say
from splitbus.cli.embedded import SyncClient
from splitbus.env import Env
from splitbus.masking import mask_text, mask_url

CLEAR_SCREEN = "\033[2J\033[H"  # between refreshes of --watch


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("status", help="workers, queues, pending entries, dead letters, P-D connections")
    add_redis_url_argument(p)
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    p.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2)",
    )
    p.set_defaults(run=run)


def collect(client: SyncClient, prefix: str, cell: str) -> dict[str, Any]:
    from splitbus.bus.keys import Keys

    keys = Keys(prefix, cell)
    now_ms = _server_ms(client)
    ids = _worker_ids(client, keys)
    return {
        "workers": [_worker(client, keys, wid, now_ms) for wid in ids],
        "streams": [_stream(client, name, now_ms) for name in _streams(client, keys, ids)],
        "dead_letters": client.xlen(keys.dead) if client.exists(keys.dead) else 0,
        "links": [
            _link(client, key)
            for key in sorted(client.scan_iter(match=keys.rdma("*", "*").replace("{*}", "*"), count=1000))
        ],
    }


def _worker_ids(client: SyncClient, keys: Any) -> list[str]:
    """The registry's live set (a worker whose lease lapsed stays there until a reaper takes it),
    then the workers a reaper marked dead (``state`` = dead, kept an hour). A worker that stopped
    cleanly has no record left: its task stream, also kept an hour, belongs to an earlier run."""
    listed = cast("list[str]", client.zrange(keys.workers, 0, -1))  # the client decodes replies
    records = client.scan_iter(match=keys.worker("*"), count=1000)  # braces are plain in a MATCH pattern
    dead = sorted(key.partition("}:")[2] for key in records if client.hget(key, "state") == "dead")
    return listed + [wid for wid in dead if wid not in listed]


def _server_ms(client: SyncClient) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _worker(client: SyncClient, keys: Any, wid: str, now_ms: int) -> dict[str, Any]:
    h = client.hgetall(keys.worker(wid))
    lease = client.pttl(keys.lease(wid))
    ints = ("running", "waiting", "queued_prefill_tokens", "free_kv_blocks", "total_kv_blocks", "dp_rank")
    row: dict[str, Any] = {
        "id": wid,
        "role": h.get("role", "?"),
        "model": h.get("model", "?"),
        "alive": lease > 0,
        "lease_ms": max(lease, 0),
        "heartbeat_age_ms": now_ms - int(h.get("heartbeat_ms", now_ms)),
    }
    row.update({k: int(h.get(k, 0)) for k in ints})
    row["dp_group"] = h.get("dp_group", "")
    return row


def _streams(client: SyncClient, keys: Any, worker_ids: list[str]) -> list[str]:
    """The request stream, and the task streams of the workers shown (not of earlier runs)."""
    tasks = sorted(name for name in map(keys.tasks, worker_ids) if client.exists(name))
    return [keys.requests, *tasks]


def _stream(client: SyncClient, name: str, now_ms: int) -> dict[str, Any]:
    row: dict[str, Any] = {"stream": name, "length": client.xlen(name), "groups": []}
    for group in client.xinfo_groups(name) if client.exists(name) else []:
        pending = int(group["pending"])
        oldest = None
        if pending:
            first = client.xpending_range(name, group["name"], "-", "+", 1)
            oldest = now_ms - int(str(first[0]["message_id"]).split("-")[0]) if first else None
        row["groups"].append(
            {
                "group": group["name"],
                "consumers": int(group["consumers"]),
                "pending": pending,
                "lag": group.get("lag"),
                "oldest_pending_ms": oldest,
            }
        )
    return row


def _link(client: SyncClient, key: str) -> dict[str, Any]:
    h = client.hgetall(key)
    return {
        "prefill": h.get("prefill"),
        "decode": h.get("decode"),
        "state": h.get("state"),
        "error": h.get("error", ""),
    }


def render(status: dict[str, Any]) -> str:
    lines = [
        f"{'WORKER':<34} {'ROLE':<8} {'DP':<6} {'LEASE':>6} {'RUN':>4} {'WAIT':>5} {'PREFILL TOK':>11} "
        f"{'FREE/TOTAL KV':>15}"
    ]
    for w in status["workers"]:
        dp = f"{w['dp_group']}/{w['dp_rank']}" if w["dp_group"] else "-"
        lease = f"{w['lease_ms'] / 1000:.1f}s" if w["alive"] else "DEAD"
        lines.append(
            f"{w['id']:<34} {w['role']:<8} {dp:<6} {lease:>6} {w['running']:>4} {w['waiting']:>5} "
            f"{w['queued_prefill_tokens']:>11} "
            f"{w['free_kv_blocks']:>7}/{w['total_kv_blocks']:<7}"
        )
    lines += ["", f"{'STREAM':<40} {'LENGTH':>7} {'GROUP':<11} {'PENDING':>7} {'LAG':>5} {'OLDEST PENDING':>14}"]
    for s in status["streams"]:
        for g in s["groups"] or [{"group": "-", "pending": 0, "lag": None, "oldest_pending_ms": None}]:
            lag = "-" if g["lag"] is None else str(g["lag"])
            oldest = "-" if g["oldest_pending_ms"] is None else f"{g['oldest_pending_ms'] / 1000:.1f}s"
            lines.append(f"{s['stream']:<40} {s['length']:>7} {g['group']:<11} {g['pending']:>7} {lag:>5} {oldest:>14}")
    lines += ["", f"dead letters: {status['dead_letters']}", "P-D links:" + ("" if status["links"] else " none")]
    lines += [
        f"  {link['prefill']} -> {link['decode']}: {link['state']} {link['error']}".rstrip() for link in status["links"]
    ]
    return "\n".join(lines)


_UNREACHABLE = (redis.RedisError, RedisClusterException, OSError)


def run(args: argparse.Namespace, env: Env) -> int:
    url = redis_url(args, env)
    try:
        client = connect_sync(url, decode_responses=True, socket_timeout=5)  # a cluster's client connects here
    except ValueError as exc:  # a cluster URL that does not read
        say(f"splitbus status: {exc}")
        return 2
    except _UNREACHABLE as exc:
        return _unreachable(url, exc)
    try:
        while _show(_text(collect(client, env.prefix, env.cell), args.json)):
            if args.watch is None:
                return 0
            time.sleep(args.watch)
            if not args.json and not _show(CLEAR_SCREEN):
                break
        return 0  # stdout was closed: whoever read it has what they wanted
    except _UNREACHABLE as exc:
        return _unreachable(url, exc)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def _unreachable(url: str, exc: BaseException) -> int:
    say(f"splitbus status: Redis at {mask_url(url)} is not reachable: {mask_text(str(exc))}")
    return 1


def _text(status: dict[str, Any], as_json: bool) -> str:
    return json.dumps(status) if as_json else render(status)


def _show(text: str) -> bool:
    """Print ``text``; False once stdout is closed (``status --watch | head`` has ended). Python
    ignores SIGPIPE, so that is a BrokenPipeError, not a Redis problem: stdout is pointed at
    /dev/null, so the flush at exit raises nothing either, and status ends quietly."""
    try:
        say(text)
        return True
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return False
