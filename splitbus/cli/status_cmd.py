"""``splitbus status``: workers, streams, dead letters and P-D links, read from Redis.

Works on Redis 6.2 (no ``lag`` in XINFO GROUPS: shown as "-") and 7.

Whoever holds the Redis credentials can write anything it reads, and status is what an operator
runs when something is wrong: a worker hash is read through the registry's own checks
(``Registry.row``, as schedulers read it) and a bad one is shown as such; text that is not UTF-8
is replaced, a key of the wrong type reads as empty, and the table shows no control character
and no string longer than any honest name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import redis
from redis.client import NEVER_DECODE
from redis.exceptions import RedisClusterException

from splitbus.bus.core.connection import connect_sync
from splitbus.bus.messages._check import MAX_NAME_CHARS
from splitbus.bus.registry import ROW_ERRORS, Registry, WorkerInfo
from splitbus.cli.common import add_redis_url_argument, redis_url, say
from splitbus.cli.embedded import SyncClient
from splitbus.env import Env
from splitbus.masking import mask_text, mask_url

CLEAR_SCREEN = "\033[2J\033[H"  # between refreshes of --watch
SHOWN_EXPERTS = 16
"""A MoE worker's row shows the tokens of this many of its experts (``--json``: all)."""
MAX_SHOWN_CHARS = 2 * MAX_NAME_CHARS
"""Longest string the table shows whole: an honest id or name (at most ``MAX_NAME_CHARS``) and the
key names built from one fit; a forged longer one is cut."""
T = TypeVar("T")


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
    from splitbus.bus.core.keys import Keys

    keys = Keys(prefix, cell)
    now_ms = _server_ms(client)
    ids = _worker_ids(client, keys)
    rows = [_worker(client, keys, wid, now_ms) for wid in ids]
    return {
        "workers": [row for row in rows if "invalid" not in row],
        "invalid_workers": [row for row in rows if "invalid" in row],
        "streams": [_stream(client, name, now_ms) for name in _streams(client, keys, ids)],
        "dead_letters": _stream_length(client, keys.dead) or 0,
        "links": [
            _link(client, key)
            for key in sorted(client.scan_iter(match=keys.rdma("*", "*").replace("{*}", "*"), count=1000))
        ],
        "tenants": _tenants(client, keys, now_ms),
    }


def _tenants(client: SyncClient, keys: Any, now_ms: int) -> list[dict[str, Any]]:
    """Each stored tenant's limits and, for one with a ``concurrency`` limit, its requests in flight
    (their leases, across every API node); a bad record as ``invalid``."""
    from splitbus.bus.tenants import BadTenantRecord, Tenant, stored_tenants

    none: list[Tenant | BadTenantRecord] = []
    tenants = _unless_wrong_type(lambda: stored_tenants(client, keys), none)
    return [
        {"invalid": str(t)} if isinstance(t, BadTenantRecord) else _tenant(client, keys, t, now_ms) for t in tenants
    ]


def _tenant(client: SyncClient, keys: Any, tenant: Any, now_ms: int) -> dict[str, Any]:
    from splitbus.bus.limits import in_flight

    held = None
    if tenant.limits.concurrency:  # only then are leases taken
        held = _unless_wrong_type(lambda: in_flight(client, keys, tenant.name, now_ms), 0)
    return {"name": tenant.name, "in_flight": held, **tenant.limits.to_json()}


def _unless_wrong_type(read: Callable[[], T], default: T) -> T:
    """``read()``, or ``default`` when its key holds another type than the command's (WRONGTYPE):
    a key a forger replaced must not hide the rest of the view."""
    try:
        return read()
    except redis.ResponseError as exc:
        if not str(exc).startswith("WRONGTYPE"):
            raise
        return default


def _stream_length(client: SyncClient, key: str) -> int | None:
    """The stream's length; None when there is none (no key, or a key of another type)."""
    if not client.exists(key):
        return None
    return _unless_wrong_type(lambda: int(client.xlen(key)), None)


def _worker_ids(client: SyncClient, keys: Any) -> list[str]:
    """The registry's live set (a worker whose lease lapsed stays there until a reaper takes it),
    then the workers a reaper marked dead (``state`` = dead, kept an hour). A worker that stopped
    cleanly has no record left: its task stream, also kept an hour, belongs to an earlier run."""
    listed: list[str] = _unless_wrong_type(lambda: cast("list[str]", client.zrange(keys.workers, 0, -1)), [])
    records = client.scan_iter(match=keys.worker("*"), count=1000)  # braces are plain in a MATCH pattern
    dead = sorted(key.partition("}:")[2] for key in records if _state(client, key) == "dead")
    return listed + [wid for wid in dead if wid not in listed]


def _state(client: SyncClient, key: str) -> str | None:
    return _unless_wrong_type(lambda: cast("str | None", client.hget(key, "state")), None)


def _server_ms(client: SyncClient) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _worker(client: SyncClient, keys: Any, wid: str, now_ms: int) -> dict[str, Any]:
    """A worker's row; one with ``invalid`` (the reason, e.g. ``running must be >= 0, got -5``)
    instead of its record's fields when the registry's checks refuse the record."""
    lease = int(client.pttl(keys.lease(wid)))
    head = {"id": wid, "alive": lease > 0, "lease_ms": max(lease, 0)}
    record = _unless_wrong_type(lambda: _stored_hash(client, keys.worker(wid)), None)
    if record is None:
        return {**head, "invalid": "not a hash"}
    try:
        return {**head, **_shown_record(Registry.row(lease, record), now_ms)}
    except ROW_ERRORS as exc:
        return {**head, "invalid": str(exc)}


def _stored_hash(client: SyncClient, key: str) -> dict[bytes, bytes]:
    """A hash as stored, not decoded: ``Registry.row`` decodes it (and refuses what is not UTF-8)."""
    return cast("dict[bytes, bytes]", client.execute_command("HGETALL", key, **{NEVER_DECODE: []}))


def _shown_record(info: WorkerInfo, now_ms: int) -> dict[str, Any]:
    record, load = info.record, info.record.load
    return {
        "role": record.role,
        "model": record.model,
        "heartbeat_age_ms": now_ms - (info.heartbeat_ms or now_ms),
        "running": load.running,
        "waiting": load.waiting,
        "queued_prefill_tokens": load.queued_prefill_tokens,
        "free_kv_blocks": load.free_kv_blocks,
        "total_kv_blocks": load.total_kv_blocks,
        "dp_rank": record.dp_rank,
        "dp_group": record.dp_group,
        "experts": load.experts.to_json() if load.experts is not None else None,
    }


def _streams(client: SyncClient, keys: Any, worker_ids: list[str]) -> list[str]:
    """The request stream, and the task streams of the workers shown (not of earlier runs)."""
    tasks = sorted(name for name in map(keys.tasks, worker_ids) if _stream_length(client, name) is not None)
    return [keys.requests, *tasks]


def _stream(client: SyncClient, name: str, now_ms: int) -> dict[str, Any]:
    length = _stream_length(client, name)
    row: dict[str, Any] = {"stream": name, "length": length or 0, "groups": []}
    for group in client.xinfo_groups(name) if length is not None else []:
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
    h: dict[str, str] = _unless_wrong_type(lambda: cast("dict[str, str]", client.hgetall(key)), {"state": "not a hash"})
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
    lines += _worker_lines(status["workers"])
    lines += [f"{_shown(w['id']):<34} invalid record: {_shown(w['invalid'])}" for w in status["invalid_workers"]]
    lines += ["", f"{'STREAM':<40} {'LENGTH':>7} {'GROUP':<11} {'PENDING':>7} {'LAG':>5} {'OLDEST PENDING':>14}"]
    for s in status["streams"]:
        for g in s["groups"] or [{"group": "-", "pending": 0, "lag": None, "oldest_pending_ms": None}]:
            lag = "-" if g["lag"] is None else str(g["lag"])
            oldest = "-" if g["oldest_pending_ms"] is None else f"{g['oldest_pending_ms'] / 1000:.1f}s"
            lines.append(
                f"{_shown(s['stream']):<40} {s['length']:>7} {_shown(g['group']):<11} {g['pending']:>7} {lag:>5} "
                f"{oldest:>14}"
            )
    lines += ["", f"dead letters: {status['dead_letters']}", "P-D links:" + ("" if status["links"] else " none")]
    lines += [
        _shown(f"  {link['prefill']} -> {link['decode']}: {link['state']} {link['error']}".rstrip())
        for link in status["links"]
    ]
    return "\n".join(lines + _tenant_lines(status["tenants"]))


def _tenant_lines(tenants: list[dict[str, Any]]) -> list[str]:
    """The tenants' table: in flight (of ``concurrency``; "-" for a tenant without that limit,
    which takes no lease) and the limits; none when the cell has no tenant."""
    if not tenants:
        return []
    lines = ["", f"{'TENANT':<24} {'IN FLIGHT':>12} LIMITS"]
    for t in tenants:
        if "invalid" in t:
            lines.append(f"{'?':<24} invalid record: {_shown(t['invalid'])}")
            continue
        held = "-" if t["in_flight"] is None else f"{t['in_flight']}/{t['concurrency']}"
        limits = ", ".join(f"{k} {v:g}" for k, v in t.items() if k not in ("name", "in_flight"))
        lines.append(f"{_shown(t['name']):<24} {held:>12} {limits}")
    return lines


def _worker_line(w: dict[str, Any]) -> str:
    dp = _shown(f"{w['dp_group']}/{w['dp_rank']}") if w["dp_group"] else "-"
    lease = f"{w['lease_ms'] / 1000:.1f}s" if w["alive"] else "DEAD"
    return (
        f"{_shown(w['id']):<34} {w['role']:<8} {dp:<6} {lease:>6} {w['running']:>4} {w['waiting']:>5} "
        f"{w['queued_prefill_tokens']:>11} {w['free_kv_blocks']:>7}/{w['total_kv_blocks']:<7}"
    )


def _worker_lines(workers: list[dict[str, Any]]) -> list[str]:
    """Each worker's row, a MoE worker's experts under it."""
    return [line for w in workers for line in (_worker_line(w), *_experts_line(w["experts"]))]


def _experts_line(experts: dict[str, Any] | None) -> list[str]:
    """A MoE worker's experts under its row: the held range, its weights, and the tokens each held
    expert took since the start (the first ``SHOWN_EXPERTS``)."""
    if experts is None:
        return []
    (first, end), counts = experts["held"], experts["total_tokens"]
    more = f" ... ({len(counts) - SHOWN_EXPERTS} more)" if len(counts) > SHOWN_EXPERTS else ""
    weights = experts["weight_bytes"]
    return [
        f"  experts {first}-{end - 1} of {experts['experts_per_layer']}, "
        f"{weights['dense'] / 2**20:.1f} + {weights['experts'] / 2**20:.1f} MiB of weights, "
        f"tokens since start: {' '.join(map(str, counts[:SHOWN_EXPERTS]))}{more}"
    ]


def _shown(text: object) -> str:
    """``text`` for a terminal: a control character (a forged escape sequence could clear the
    screen or rewrite the rows above) shown as ``?``, and cut after ``MAX_SHOWN_CHARS``."""
    full = str(text)
    clean = "".join(c if c.isprintable() else "?" for c in full[:MAX_SHOWN_CHARS])
    return clean if len(full) <= MAX_SHOWN_CHARS else f"{clean}... ({len(full)} characters)"


_UNREACHABLE = (redis.RedisError, RedisClusterException, OSError)


def run(args: argparse.Namespace, env: Env) -> int:
    url = redis_url(args, env)
    try:
        # A reply that is not UTF-8 reads with U+FFFD (worker hashes are read undecoded: _stored_hash).
        # A cluster's client connects here.
        client = connect_sync(url, decode_responses=True, encoding_errors="replace", socket_timeout=5)
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
