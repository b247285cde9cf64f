"""Drive prefill and decode workers through requests, with no scheduler running, using only the
documented Redis protocol (docs/protocol.md) and redis-py (on a single Redis or a cluster).

    export SPLITBUS_REDIS_URL=redis://splitbus:PASSWORD@127.0.0.1:6379/0   # not on argv: it holds the password
    python examples/external_dispatcher.py --prompt-ids 72,105 --max-tokens 8
    python examples/external_dispatcher.py --dp --requests 4 --max-tokens 8

One pair: it finds a live prefill and decode worker in the registry, asks each for its payload
(``get_payload``), connects P to D (``connect_rdma``), writes the decode task and then the
prefill task, and prints the request's result stream until its final entry.

``--dp``, rank-level dispatch (EP + PD): it finds the complete prefill and decode DP groups in
the registry (single workers count as groups of one), asks every rank for its payload, and
picks a prefill rank and a decode rank for each request itself: the prefill rank with the
fewest queued prompt tokens, the decode rank that keeps its group's busiest rank lowest (a
group steps together, so its step lasts as long as that rank's). The prefill tasks that go to
one group carry a batch id and the number of its ranks they went to, so those ranks prefill
them in the same step. Then it prints every request's result stream until its final entry.

``--redis-url`` (default: ``SPLITBUS_REDIS_URL``, then redis://127.0.0.1:6379/0), ``--prefix``
(default: ``SPLITBUS_PREFIX``, then ``sb``) and ``--cell`` (default: ``SPLITBUS_CELL``, then
``main``): give a URL with a password through the environment, never on the command line, which
other users of the machine can read.

It needs redis-py only, no splitbus: the protocol is the contract, for a dispatcher in any
language. The URL is what ``splitbus up`` gives its parts (``splitbus status`` shows it masked):

- one Redis: ``redis://splitbus:PASSWORD@127.0.0.1:PORT/0`` (``rediss://`` for TLS), opened with
  ``redis.Redis.from_url``. ``up``'s embedded Redis keeps the ``splitbus`` user's password in
  ``DATA_DIR/redis/splitbus.password`` (mode 0600; ``DATA_DIR`` is ``.splitbus`` by default);
- a Redis Cluster: ``redis+cluster://splitbus:PASSWORD@host:port,host:port,...`` (plain TCP), or
  ``rediss+cluster://...?ssl_ca_certs=CA&ssl_certfile=CERT&ssl_keyfile=KEY``: TLS, the nodes'
  certificates checked against CA, CERT and KEY the client's own (:func:`connect`). ``up
  --redis-cluster N`` keeps the password in ``DATA_DIR/redis-cluster/splitbus.password`` and the
  certificates in ``DATA_DIR/redis-cluster/tls/``: ``ca.crt``, ``client.crt``, ``client.key``
  (0600, readable by the user who ran ``up`` only; a dispatcher run as another user needs copies,
  and the client key is more than a login: it opens the nodes' cluster-bus ports too, where its
  holder could disturb failovers and slot ownership, so copy it only to programs trusted as the
  cluster's own parts are).
  A ``redis.RedisCluster`` sends each command to the node that serves its key; what one command
  names shares a hash tag, so it needs no more.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import ssl
import sys
import time
import uuid
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

import redis
from redis.cluster import ClusterNode

READER = "external-dispatcher"
"""The API node the requests name, and so the hash tag of their result streams."""


@dataclass(frozen=True)
class Names:
    """The key names of docs/bus.md: the control plane under the cell's tag, result streams
    under their reader's."""

    prefix: str
    cell: str

    def control(self, kind: str, name: str = "") -> str:
        """``sb:<kind>:{cell}``, then ``:<name>`` (a worker's id) if given."""
        key = f"{self.prefix}:{kind}:{{{self.cell}}}"
        return f"{key}:{name}" if name else key

    def out(self, request_id: str) -> str:
        return f"{self.prefix}:out:{{{READER}}}:{request_id}"


def command(
    r: redis.Redis, names: Names, worker: str, cmd: str, args: dict | None = None, timeout_s: float = 5.0
) -> dict:
    """Send a control command; return its reply's data (raises if the worker refused it)."""
    task_id = uuid.uuid4().hex
    data = {"task_id": task_id, "cmd": cmd, "args": args or {}}
    r.xadd(names.control("ctrl", worker), {"type": "command", "data": json.dumps(data)})
    reply = r.xread({f"{names.prefix}:reply:{{{task_id}}}": "0"}, count=1, block=int(timeout_s * 1000))
    if not reply:
        raise TimeoutError(f"{worker} did not answer {cmd}")
    answer = json.loads(reply[0][1][0][1]["data"])
    if not answer["ok"]:
        raise RuntimeError(f"{worker} refused {cmd}: {answer['error']}")
    return answer["result"]


def live_workers(r: redis.Redis, names: Names) -> dict[str, dict]:
    """Registered workers whose lease has not expired, by id."""
    found = {}
    for worker in r.zrange(names.control("workers"), 0, -1):
        record = r.hgetall(names.control("worker", worker))
        if record and r.exists(names.control("lease", worker)) and record.get("state") != "dead":
            found[worker] = record
    return found


def pick(workers: dict[str, dict], role: str) -> str:
    ids = [w for w, record in workers.items() if record["role"] == role]
    if not ids:
        sys.exit(f"no live {role} worker is registered")
    return ids[0]


def task(phase: str, peer: str, request: dict, **extra: object) -> dict:
    return {"type": "task", "data": json.dumps({"phase": phase, "peer": peer, "request": request, **extra})}


def new_request(model: str, args: argparse.Namespace, request_id: str, seed: int) -> dict:
    return {
        "request_id": request_id,
        "model": model,
        "api_node": READER,  # no "reader": the result stream is tagged by the api_node
        "prompt_token_ids": [int(t) for t in args.prompt_ids.split(",")],
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0, "seed": seed},
        "deadline_ms": int(time.time() * 1000) + 60_000,
    }


def follow(r: redis.Redis, names: Names, request_id: str, timeout_s: float) -> dict:
    """Print the result stream's entries in order; return the final (or error) entry."""
    key, last, deadline = names.out(request_id), "0", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, entries in r.xread({key: last}, block=1000) or []:
            for entry_id, fields in entries:
                last = entry_id
                entry = json.loads(fields["data"])
                print(f"{fields['type']:<6} {json.dumps(entry)}", flush=True)
                if fields["type"] in ("final", "error"):
                    return entry
    raise TimeoutError(f"no final entry for {request_id} within {timeout_s:g} s")


def one_pair(r: redis.Redis, args: argparse.Namespace) -> int:
    """The request through one prefill and one decode worker."""
    workers = live_workers(r, args.names)
    prefill, decode = pick(workers, "prefill"), pick(workers, "decode")
    for worker in (prefill, decode):
        p = command(r, args.names, worker, "get_payload")
        blocks = f"{p['free_kv_blocks']}/{p['total_kv_blocks']}"
        print(f"{worker}: {p['role']}, {blocks} KV blocks free, {p['running_requests']} running")
    link = command(r, args.names, prefill, "connect_rdma", {"decode_worker": decode})
    print(f"{prefill} -> {decode}: {link['state']} ({link['endpoint']})")

    request_id = f"ext-{uuid.uuid4().hex[:12]}"
    request = new_request(workers[decode]["model"], args, request_id, args.seed)
    # D first: it reserves KV blocks and publishes the reservation (sb:kv:{cell}:<id>) with a secret
    # that P proves when it sends the cache. Both tasks carry the same request (and, for a
    # request that continues, the same first_seq and output_token_ids).
    r.xadd(args.names.control("tasks", decode), task("decode", prefill, request))
    r.xadd(args.names.control("tasks", prefill), task("prefill", decode, request))
    final = follow(r, args.names, request_id, timeout_s=60)
    return 0 if "finish_reason" in final else 1


# --- DP mode: rank-level dispatch -------------------------------------------------------------


@dataclass
class Rank:
    """A rank (or single worker) as its payload shows it, plus what this run has sent it."""

    worker: str
    group: str
    rank: int
    size: int
    queued_tokens: int
    requests: int
    free_blocks: int
    block_size: int


def number(value: object, default: int = 0) -> int:
    """A registry field as an integer (the registry is data, not code: anything may be there)."""
    try:
        return int(str(value))
    except ValueError:
        return default


def complete_groups(workers: dict[str, dict], role: str) -> dict[str, list[str]]:
    """Live ranks of ``role`` by group, for the groups whose ranks 0..size-1 are all live and agree
    on the size and on the epoch they formed (``dp_epoch``; 0 while forming): a group one rank short,
    or with a restarted rank not yet stepping with the others, cannot step, and work sent to it waits
    or fails. A worker outside any group is a group of one, named by its id."""
    ranks: dict[str, dict[int, str]] = {}
    sizes: dict[str, set[int]] = {}
    epochs: dict[str, set[int]] = {}
    for worker, record in sorted(workers.items()):
        size = number(record.get("dp_size"))
        if record.get("role") != role or size > 1024:
            continue
        group, rank = (record.get("dp_group", ""), number(record.get("dp_rank"), -1)) if size > 0 else (worker, 0)
        taken = rank in ranks.setdefault(group, {})  # two workers claiming one rank: not a group to trust
        ranks[group][rank] = worker
        sizes.setdefault(group, set()).add(-1 if taken else max(size, 1))
        epochs.setdefault(group, set()).add(number(record.get("dp_epoch")) if size > 0 else 1)
    whole = {
        g: by_rank
        for g, by_rank in ranks.items()
        if [sorted(by_rank)] == [list(range(n)) for n in sizes[g]] and len(epochs[g]) == 1 and 0 not in epochs[g]
    }
    return {g: [by_rank[i] for i in sorted(by_rank)] for g, by_rank in whole.items()}


def payload_rank(r: redis.Redis, names: Names, worker: str, group: str) -> Rank:
    """The rank's load to the moment (``get_payload``), checked against the group it is listed in."""
    p = command(r, names, worker, "get_payload")
    if p["dp_size"] > 0 and p["dp_group"] != group:
        raise RuntimeError(f"{worker} says it is in group {p['dp_group']!r}, the registry says {group!r}")
    size, rank = max(p["dp_size"], 1), max(p["dp_rank"], 0)
    queued = p["queued_prefill_tokens"]
    requests = p["running_requests"] + p["waiting_requests"] + p["unhandled_requests"]
    return Rank(worker, group, rank, size, queued, requests, p["free_kv_blocks"], p["block_size"])


def ranks_of(r: redis.Redis, args: argparse.Namespace, workers: dict[str, dict], role: str) -> dict[str, list[Rank]]:
    groups = complete_groups(workers, role)
    if not groups:
        sys.exit(f"no complete {role} group (or single {role} worker) is live")
    found = {g: [payload_rank(r, args.names, w, g) for w in ids] for g, ids in groups.items()}
    for rank in (rank for ranks in found.values() for rank in ranks):
        print(
            f"{rank.worker}: {role} rank {rank.rank} of {rank.group} ({rank.size}), {rank.queued_tokens} queued "
            f"prompt tokens, {rank.requests} requests, {rank.free_blocks} KV blocks free"
        )
    return found


def prefill_rank(groups: dict[str, list[Rank]], request: dict) -> Rank:
    """The rank with the fewest queued prompt tokens, counting what this run sent (first on ties)."""
    best = min((rank for ranks in groups.values() for rank in ranks), key=lambda rank: rank.queued_tokens)
    best.queued_tokens += len(request["prompt_token_ids"])
    return best


def decode_rank(groups: dict[str, list[Rank]], request: dict) -> Rank:
    """Among ranks with KV room for the request: the one that leaves its group's busiest rank
    least busy (a group's step lasts as long as that rank's), then the least busy rank, then the
    most free KV blocks."""
    tokens = len(request["prompt_token_ids"]) + request["sampling"]["max_tokens"]
    options = []
    for ranks in groups.values():
        busiest = max(rank.requests for rank in ranks)
        for rank in ranks:
            if rank.free_blocks >= math.ceil(tokens / rank.block_size):
                options.append(((max(busiest, rank.requests + 1), rank.requests, -rank.free_blocks), rank))
    if not options:
        sys.exit(f"no decode rank has KV room for {request['request_id']}")
    best = min(options, key=lambda option: option[0])[1]
    best.requests += 1
    best.free_blocks -= math.ceil(tokens / best.block_size)
    return best


def write_dp(r: redis.Redis, names: Names, pairs: list[tuple[dict, Rank, Rank]], batch: str) -> None:
    """All decode tasks first (each D reserves the KV and publishes the reservation), then the
    prefill tasks, each with its group's batch id and how many of the group's ranks the batch
    went to: those ranks wait for each other's part and prefill it in one step."""
    ranks_in: dict[str, set[str]] = {}
    for _, p, _ in pairs:
        ranks_in.setdefault(p.group, set()).add(p.worker)
    handoffs = [uuid.uuid4().hex[:16] for _ in pairs]  # one per dispatch, the same in both tasks
    for (request, p, d), handoff in zip(pairs, handoffs, strict=True):
        r.xadd(names.control("tasks", d.worker), task("decode", p.worker, request, handoff=handoff))
    for (request, p, d), handoff in zip(pairs, handoffs, strict=True):
        batch_fields = {"batch_id": f"{batch}.{p.group}", "batch_ranks": len(ranks_in[p.group])}
        r.xadd(names.control("tasks", p.worker), task("prefill", d.worker, request, handoff=handoff, **batch_fields))


def follow_all(r: redis.Redis, names: Names, request_ids: list[str], timeout_s: float) -> dict[str, dict]:
    """Print every result stream's entries as they come, with the request id; return each
    request's final (or error) entry."""
    last = {names.out(rid): "0" for rid in request_ids}
    ends: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while last and time.monotonic() < deadline:
        for key, entries in r.xread(last, block=1000) or []:
            rid = key.split("}:", 1)[1]  # the id follows the tag
            for entry_id, fields in entries:
                last[key] = entry_id
                print(f"{fields['type']:<6} {rid} {fields['data']}", flush=True)
                if fields["type"] in ("final", "error"):
                    ends[rid] = json.loads(fields["data"])
                    del last[key]
    if last:
        raise TimeoutError(f"no final entry for {len(last)} request(s) within {timeout_s:g} s")
    return ends


def dp(r: redis.Redis, args: argparse.Namespace) -> int:
    """``--requests`` requests, each through a prefill rank and a decode rank picked here."""
    live = live_workers(r, args.names)
    model = args.model or next((record.get("model", "") for record in live.values()), "")
    workers = {w: record for w, record in live.items() if record.get("model") == model}
    prefill, decode = ranks_of(r, args, workers, "prefill"), ranks_of(r, args, workers, "decode")
    run = uuid.uuid4().hex[:8]
    pairs = []
    for i in range(args.requests):
        request = new_request(model, args, f"ext-{run}-{i}", args.seed + i)
        p, d = prefill_rank(prefill, request), decode_rank(decode, request)
        print(f"{request['request_id']}: seed {args.seed + i}, prefill {p.worker} -> decode {d.worker}")
        pairs.append((request, p, d))
    for p_worker, d_worker in dict.fromkeys((p.worker, d.worker) for _, p, d in pairs):
        link = command(r, args.names, p_worker, "connect_rdma", {"decode_worker": d_worker})
        print(f"{p_worker} -> {d_worker}: {link['state']}")
    write_dp(r, args.names, pairs, f"ext-{run}")
    ends = follow_all(r, args.names, [request["request_id"] for request, _, _ in pairs], timeout_s=60)
    return 0 if all("finish_reason" in end for end in ends.values()) else 1


def connect(url: str) -> redis.Redis:
    """A client for ``url``: ``redis.Redis.from_url``, or a ``redis.RedisCluster`` for a
    ``redis+cluster://`` or ``rediss+cluster://`` URL (see the module's text). With TLS the nodes'
    certificates are always verified, against the URL's CA alone (:class:`PinnedSSLConnection`):
    a listener that cannot show one that CA signed never gets the password."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in ("redis+cluster", "rediss+cluster"):
        return redis.Redis.from_url(url, decode_responses=True)
    userinfo, _, location = rest.rpartition("@")
    hosts, _, query = location.partition("?")
    user, _, password = userinfo.partition(":")
    cluster = redis.RedisCluster(
        startup_nodes=[_node(part) for part in hosts.split("/")[0].split(",")],
        username=unquote(user) or None,
        password=unquote(password) or None,
        require_full_coverage=False,  # the other primaries' keys stay served while one fails over
        decode_responses=True,
        **(_tls(query) if scheme.lower() == "rediss+cluster" else {}),
    )
    return cluster  # the same command methods as redis.Redis


TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")


def _tls(query: str) -> dict:
    """redis-py's TLS settings from a ``rediss+cluster://`` URL's query (its names for ``rediss://``).
    An option it does not know is refused, not ignored: a misspelt ``ssl_ca_certs`` would leave
    the nodes unchecked against the cluster's CA."""
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(options) - set(TLS_OPTIONS)
    if unknown or "ssl_ca_certs" not in options:
        raise ValueError(f"a rediss+cluster URL here takes ssl_ca_certs and only {', '.join(TLS_OPTIONS)}")
    return {
        "ssl": True,
        "ssl_cert_reqs": "required",
        "ssl_ca_certs": options["ssl_ca_certs"],
        "ssl_certfile": options.get("ssl_certfile"),
        "ssl_keyfile": options.get("ssl_keyfile"),
        "ssl_check_hostname": options.get("ssl_check_hostname", "true").lower() not in ("false", "no", "0"),
        "connection_class": PinnedSSLConnection,
    }


class PinnedSSLConnection(redis.SSLConnection):
    """redis-py's TLS connection, trusting the URL's CA alone. redis-py's own starts from the
    system's trusted CAs and adds ``ssl_ca_certs`` to them, so a listener whose certificate any of
    those signed would be taken for a node and sent the password."""

    def _build_ssl_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # certificates required, host names checked
        context.check_hostname = self.check_hostname
        context.load_verify_locations(cafile=self.ca_certs)
        if self.certfile:
            context.load_cert_chain(self.certfile, self.keyfile)
        return context


def _node(text: str) -> ClusterNode:
    """``host:port`` or ``[v6]:port``."""
    host, _, port = text.rpartition(":")
    return ClusterNode(host.strip("[]"), int(port))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("SPLITBUS_REDIS_URL") or "redis://127.0.0.1:6379/0")
    parser.add_argument("--prefix", default=os.environ.get("SPLITBUS_PREFIX") or "sb")
    parser.add_argument("--cell", default=os.environ.get("SPLITBUS_CELL") or "main")
    parser.add_argument("--prompt-ids", default="72,101,108,108,111", help="comma-separated prompt token ids")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1, help="the first request's seed (--dp: request i has seed + i)")
    parser.add_argument("--dp", action="store_true", help="rank-level dispatch over prefill and decode DP groups")
    parser.add_argument("--model", default="", help="--dp: the served model (default: the first live worker's)")
    parser.add_argument("--requests", type=int, default=4, help="--dp: how many requests to spread over the ranks")
    args = parser.parse_args()
    args.names = Names(args.prefix, args.cell)
    r = connect(args.redis_url)  # redis.Redis, or RedisCluster for redis+cluster:// and rediss+cluster://
    return dp(r, args) if args.dp else one_pair(r, args)


if __name__ == "__main__":
    sys.exit(main())
