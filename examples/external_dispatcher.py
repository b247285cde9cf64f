"""Drive one prefill and one decode worker through a full request, with no scheduler running,
using only the documented Redis protocol (docs/protocol.md) and plain redis-py.

    python examples/external_dispatcher.py --redis-url redis://127.0.0.1:6379/0 --prompt-ids 72,105 --max-tokens 8

It finds a live prefill and decode worker in the registry, asks each for its payload
(``get_payload``), connects P to D (``connect_rdma``), writes the decode task and then the
prefill task, and prints the request's result stream until its final entry.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

import redis


def command(r: redis.Redis, prefix: str, worker: str, cmd: str, args: dict | None = None, timeout_s: float = 5.0) -> dict:
    """Send a control command; return its reply's data (raises if the worker refused it)."""
    task_id = uuid.uuid4().hex
    data = {"task_id": task_id, "cmd": cmd, "args": args or {}}
    r.xadd(f"{prefix}:ctrl:{{{worker}}}", {"type": "command", "data": json.dumps(data)})
    reply = r.xread({f"{prefix}:reply:{{{task_id}}}": "0"}, count=1, block=int(timeout_s * 1000))
    if not reply:
        raise TimeoutError(f"{worker} did not answer {cmd}")
    answer = json.loads(reply[0][1][0][1]["data"])
    if not answer["ok"]:
        raise RuntimeError(f"{worker} refused {cmd}: {answer['error']}")
    return answer["result"]


def live_workers(r: redis.Redis, prefix: str) -> dict[str, dict]:
    """Registered workers whose lease has not expired, by id."""
    found = {}
    for worker in r.zrange(f"{prefix}:workers", 0, -1):
        record = r.hgetall(f"{prefix}:worker:{{{worker}}}")
        if record and r.exists(f"{prefix}:lease:{{{worker}}}") and record.get("state") != "dead":
            found[worker] = record
    return found


def pick(workers: dict[str, dict], role: str) -> str:
    ids = [w for w, record in workers.items() if record["role"] == role]
    if not ids:
        sys.exit(f"no live {role} worker is registered")
    return ids[0]


def task(phase: str, peer: str, request: dict) -> dict:
    return {"type": "task", "data": json.dumps({"phase": phase, "peer": peer, "request": request})}


def follow(r: redis.Redis, prefix: str, request_id: str, timeout_s: float) -> dict:
    """Print the result stream's entries in order; return the final (or error) entry."""
    key, last, deadline = f"{prefix}:out:{{{request_id}}}", "0", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, entries in r.xread({key: last}, block=1000) or []:
            for entry_id, fields in entries:
                last = entry_id
                entry = json.loads(fields["data"])
                print(f"{fields['type']:<6} {json.dumps(entry)}", flush=True)
                if fields["type"] in ("final", "error"):
                    return entry
    raise TimeoutError(f"no final entry for {request_id} within {timeout_s:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--prefix", default="sb")
    parser.add_argument("--prompt-ids", default="72,101,108,108,111", help="comma-separated prompt token ids")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    r = redis.Redis.from_url(args.redis_url, decode_responses=True)
    workers = live_workers(r, args.prefix)
    prefill, decode = pick(workers, "prefill"), pick(workers, "decode")
    for worker in (prefill, decode):
        payload = command(r, args.prefix, worker, "get_payload")
        print(f"{worker}: {payload['role']}, {payload['free_kv_blocks']}/{payload['total_kv_blocks']} KV blocks free, {payload['running_requests']} running")
    link = command(r, args.prefix, prefill, "connect_rdma", {"decode_worker": decode})
    print(f"{prefill} -> {decode}: {link['state']} ({link['endpoint']})")

    request_id = f"ext-{uuid.uuid4().hex[:12]}"
    request = {
        "request_id": request_id, "model": workers[decode]["model"], "api_node": "external-dispatcher",
        "prompt_token_ids": [int(t) for t in args.prompt_ids.split(",")],
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0, "seed": args.seed},
        "deadline_ms": int(time.time() * 1000) + 60_000,
    }
    # D first: it reserves KV blocks and publishes the reservation (sb:kv:{id}) with a secret
    # that P proves when it sends the cache. Both tasks carry the same request (and, for a
    # request that continues, the same first_seq and output_token_ids).
    r.xadd(f"{args.prefix}:tasks:{{{decode}}}", task("decode", prefill, request))
    r.xadd(f"{args.prefix}:tasks:{{{prefill}}}", task("prefill", decode, request))
    final = follow(r, args.prefix, request_id, timeout_s=60)
    return 0 if "finish_reason" in final else 1


if __name__ == "__main__":
    sys.exit(main())
