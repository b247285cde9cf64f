"""Worker registry: a record hash, a lease key with a TTL, and a sorted set of ids.

Liveness is the lease: it exists while the worker heartbeats, and Redis expires it on the
server's clock, so a worker with a wrong clock cannot look alive. Heartbeat times are also the
server's (``TIME`` inside the script).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from splitbus import __version__
from splitbus.bus.core import codec, metrics
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import Keys
from splitbus.bus.core.replies import SnapshotReply, for_xadd, pairs, text
from splitbus.bus.core.scripts import LuaScript, declare, lua_string
from splitbus.bus.messages._check import MAX_NAME_CHARS, MAX_SEQ, PRIORITY_RANGE, require_int, require_str
from splitbus.bus.messages.kv_events import MAX_BLOCK_SIZE, MAX_DP_RANK
from splitbus.bus.records import MAX_EXPERTS, ExpertLoad, Reserved, WorkerLoad
from splitbus.bus.roles import ROLES, Word

log = logging.getLogger(__name__)

MAX_ENDPOINT_BYTES = 4 * MAX_NAME_CHARS
"""A transfer endpoint a reservation may name is at most ``MAX_NAME_CHARS`` characters."""

MAX_AMOUNT = 2**53
"""Largest token count, time (ms) or reservation a record may hold: exact in a float and in JSON."""
MAX_WORKER_KV_BLOCKS = 2**31 - 1
"""Largest ``free_kv_blocks`` / ``total_kv_blocks`` (int32): above any cache."""
MAX_COUNTER = 2**63 - 1
"""Largest cumulative counter (``steps``, ``busy_time_us``, ...): what ``HINCRBY`` can hold."""

ROW_ERRORS = (KeyError, TypeError, ValueError)
"""What ``Registry.row`` raises for a record it cannot read (a missing field: TypeError)."""

LOG_MAXLEN = 10_000
"""Entries ``sb:registry:{cell}`` keeps (``MAXLEN ~``): seconds of changes for hundreds of workers;
a view that falls further behind reads a snapshot again."""

# The registry log's entries, written here (``Registry._log`` and the heartbeat script) and by the
# dispatch script (bus/dispatch.py), read by views (bus/registry_view.py): every field name and
# word is spelled once, below; the scripts spell them with ``lua_string``.
LOG_WORKER = "w"
"""The field naming the entry's worker (every entry has it, then ``LOG_OP``)."""
LOG_OP = "op"
"""The field saying what happened (a ``LogOp``); the record's or load's fields follow it."""
LOG_AT, LOG_LEASE = "at", "lease"
"""A beat's fields after ``op``: the server's time (ms) and the lease (ms)."""


class LogOp(Word):
    """What a registry-log entry says happened to its worker (its ``op``)."""

    BEAT = "beat"
    """A heartbeat (the heartbeat script): ``at``, ``lease``, then the record's or load's fields."""
    LOAD = "load"
    """A load written outside a heartbeat (a DP rank's step), with ``+<field>`` changes to ``reserved_*``."""
    RESERVE = "reserve"
    """Schedulers reserved load on it (the dispatch script): ``+<field>`` for each ``reserved_*``."""
    GONE = "gone"
    """Deregistered, or dropped as dead: views forget it."""
    RESIGN = "resign"
    """It gave up its lease (it is stopping): views see it as not alive."""


def change_field(name: str) -> str:
    """The log field that carries a change to the record's ``name`` (a ``reserved_*`` count)."""
    return f"+{name}"


_W, _OP, _AT, _LEASE, _BEAT = map(lua_string, (LOG_WORKER, LOG_OP, LOG_AT, LOG_LEASE, LogOp.BEAT))

_HEARTBEAT = declare(
    LuaScript(
        name="heartbeat",
        module=__name__,
        keys=("sb:worker:{cell}:<worker>", "sb:lease:{cell}:<worker>", "sb:workers:{cell}", "sb:registry:{cell}"),
        argv=(
            "the worker id, the lease (ms), how many of the field, value pairs that follow the log gets too,"
            " then the record's or load's field, value pairs (those for the hash alone last: the expert load)"
        ),
        returns="the server time (ms), also written as `heartbeat_ms`, the lease's value and the id's score",
        source=f"""
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'heartbeat_ms', now_ms, unpack(ARGV, 4))
redis.call('SET', KEYS[2], now_ms, 'PX', ARGV[2])
redis.call('ZADD', KEYS[3], now_ms, ARGV[1])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', {LOG_MAXLEN}, '*', {_W}, ARGV[1], {_OP}, {_BEAT},
  {_AT}, now_ms, {_LEASE}, ARGV[2], unpack(ARGV, 4, 3 + 2 * tonumber(ARGV[3])))
return now_ms
""",
    )
)

# Reads the registry in one round trip while its set of workers stays the same: the caller
# passes the record and lease keys of the workers it knew (its last snapshot's), built by Keys,
# and reads those of workers new since then in a second step (no key name is built in Lua).
_SNAPSHOT = declare(
    LuaScript(
        name="registry_snapshot",
        module=__name__,
        keys=("sb:workers:{cell}", "sb:registry:{cell}"),
        repeated=("sb:worker:{cell}:<worker>", "sb:lease:{cell}:<worker>"),
        argv="the ids of the workers whose keys follow, in their order",
        returns=(
            "{every id in `sb:workers:{cell}`, {id, lease PTTL, record as a flat list} for each passed id still in it,"
            " the server time {s, us}, the last entry of `sb:registry:{cell}` (none: empty)}"
        ),
        source="""
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local listed = {}
for _, id in ipairs(ids) do listed[id] = true end
local rows = {}
for i, id in ipairs(ARGV) do
  if listed[id] then
    rows[#rows + 1] = {id, redis.call('PTTL', KEYS[2 * i + 2]), redis.call('HGETALL', KEYS[2 * i + 1])}
  end
end
return {ids, rows, redis.call('TIME'), redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)}
""",
    )
)


RESERVED_FIELDS = tuple(field.name for field in dataclasses.fields(Reserved))
"""The record's ``reserved_*`` counts, in this order wherever they are listed (the dispatch
script's ARGV of a task, ``+<field>`` changes in the log)."""


@dataclass
class WorkerRecord:
    """What a worker publishes about itself in ``sb:worker:{cell}:<id>`` (flat, for HGETALL)."""

    worker_id: str
    role: str
    model: str
    engine: str = ""
    dp_group: str = ""
    dp_rank: int = -1
    dp_size: int = 0
    transfer_endpoint: str = ""
    block_size: int = 16
    max_model_len: int = 0
    started_ms: int = 0
    version: str = __version__
    load: WorkerLoad = field(default_factory=WorkerLoad)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id or any(c in self.worker_id for c in " {}:"):
            raise ValueError(f"worker_id must be non-empty without spaces, braces or colons: {self.worker_id!r}")

    def to_hash(self) -> dict[str, str]:
        fields = {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "load"}
        return fields | load_hash(self.load)

    @classmethod
    def from_hash(cls, raw: Mapping[str, str]) -> WorkerRecord:
        """The record a worker hash holds; ValueError when a field is out of its range, of the
        wrong type or malformed (``_RANGES``, ``_MAX_CHARS``, ``ROLES``): whoever can write the
        hash must not draw traffic with a negative load, nor make a scheduler do arithmetic on a
        value it cannot handle."""
        load = WorkerLoad(**load_fields(raw, LOAD_FIELDS, "0"), experts=read_experts(raw))
        kwargs: dict[str, Any] = {name: parse_int(raw[name], name) for name in _RECORD_INTS if name in raw}
        for name, max_chars in _MAX_CHARS.items():
            if name in raw:
                require_str(raw[name], name, nonempty=name == "worker_id", max_chars=max_chars)
                kwargs[name] = raw[name]
        return cls(load=load, **kwargs)


LOAD_FIELDS = [f.name for f in dataclasses.fields(WorkerLoad) if f.name != "experts"]
"""The load's integer fields: the worker hash holds them, and the registry log each change."""
EXPERT_FIELDS = (
    "experts_per_layer",
    "experts_first",
    "experts_end",
    "expert_tokens_last",
    "expert_tokens_total",
    "weight_bytes_dense",
    "weight_bytes_experts",
)
"""A MoE worker's expert load (``WorkerLoad.experts``) in its hash; none for a dense worker. The
registry log does not carry them: a DP rank writes its load at every step, and the counts (one
per held expert, up to ``MAX_EXPERTS``) would multiply the log's size for readers that place
requests and never look at them."""
_EXPERT_INTS = ("experts_per_layer", "experts_first", "experts_end", "weight_bytes_dense", "weight_bytes_experts")
_RESERVED_FIELDS = [f.name for f in dataclasses.fields(Reserved)]
_RANGES: dict[str, tuple[int, int]] = {
    "running": (0, MAX_SEQ),
    "waiting": (0, MAX_SEQ),
    "queued_prefill_tokens": (0, MAX_AMOUNT),
    "free_kv_blocks": (0, MAX_WORKER_KV_BLOCKS),
    "total_kv_blocks": (0, MAX_WORKER_KV_BLOCKS),
    **dict.fromkeys(("prefills_done", "prefills_shared", "decodes_done", "steps", "idle_forwards"), (0, MAX_COUNTER)),
    **dict.fromkeys(("step_time_us", "idle_time_us", "busy_time_us", "idle_forward_us"), (0, MAX_COUNTER)),
    "forward_ends_ms": (0, MAX_AMOUNT),
    "dp_epoch": (0, MAX_AMOUNT),
    "first_queued_priority": PRIORITY_RANGE,
    **dict.fromkeys(
        ("prompt_tokens_done", "prompt_tokens_cached", "decode_tokens_done", "decode_steps"), (0, MAX_COUNTER)
    ),
    **dict.fromkeys(("prefill_busy_us", "decode_time_us"), (0, MAX_COUNTER)),
    "draining": (0, 1),
    "experts_per_layer": (1, MAX_EXPERTS),
    "experts_first": (0, MAX_EXPERTS - 1),
    "experts_end": (1, MAX_EXPERTS),
    **dict.fromkeys(("weight_bytes_dense", "weight_bytes_experts"), (0, MAX_AMOUNT)),
    "dp_rank": (-1, MAX_DP_RANK),
    "dp_size": (0, MAX_DP_RANK),
    "block_size": (1, MAX_BLOCK_SIZE),
    "max_model_len": (0, MAX_AMOUNT),
    "started_ms": (0, MAX_AMOUNT),
    "heartbeat_ms": (0, MAX_AMOUNT),
    "lease_ms": (1, MAX_SEQ),  # a beat's lease, in the registry log
    # Reservations: schedulers add, the worker subtracts what it takes; a value below zero is
    # read as zero (``reserved``), so that it cannot make a worker look emptier than it is.
    **dict.fromkeys(_RESERVED_FIELDS, (-MAX_AMOUNT, MAX_AMOUNT)),
}
"""Every integer field of a worker hash (and a beat's lease), and its range."""
_MAX_CHARS = {
    "worker_id": MAX_NAME_CHARS,
    "role": MAX_NAME_CHARS,
    "model": MAX_NAME_CHARS,
    "engine": MAX_NAME_CHARS,
    "dp_group": MAX_NAME_CHARS,
    "transfer_endpoint": MAX_ENDPOINT_BYTES,
    "version": MAX_NAME_CHARS,
}
"""Every string field of a worker record, and its longest value (``role`` is one of ``ROLES``)."""
_RECORD_INTS = [f.name for f in dataclasses.fields(WorkerRecord) if f.name != "load" and f.name not in _MAX_CHARS]
_INT = re.compile(r"-?[0-9]{1,19}")
_COUNTS = re.compile(r"[0-9]{1,19}(?:,[0-9]{1,19})*")


def parse_int(text: str, name: str) -> int:
    """One integer field of a worker hash or registry-log entry, strictly: digits only (not the
    spaces, ``_`` or ``+`` that ``int()`` takes), within ``_RANGES[name]``."""
    if not isinstance(text, str) or _INT.fullmatch(text) is None:  # the message only on failure: a hot path
        raise ValueError(f"{name} must be an integer, got {text!r:.40}")
    value = int(text)
    low, high = _RANGES[name]
    if not low <= value <= high:
        require_int(value, name, low, high)  # raises, in the words of every other bus message
    return value


def load_fields(raw: Mapping[str, str], names: Collection[str], default: str | None = None) -> dict[str, int]:
    """The load fields ``names`` of a worker hash or registry-log entry, range-checked (ValueError
    for a bad one); a missing one is ``default``, or left out when that is None."""
    if default is None:
        return {name: parse_int(raw[name], name) for name in names if name in raw}
    return {name: parse_int(raw.get(name, default), name) for name in names}


def load_hash(load: WorkerLoad) -> dict[str, str]:
    """The load's fields of a worker hash, as text: the integer ones (``LOAD_FIELDS``), then the
    expert load's (``EXPERT_FIELDS``; none without one)."""
    return {name: str(getattr(load, name)) for name in LOAD_FIELDS} | expert_hash(load.experts)


def expert_hash(experts: ExpertLoad | None) -> dict[str, str]:
    """An expert load as ``EXPERT_FIELDS``: the held range ``[experts_first, experts_end)`` and,
    for each held expert in order, its tokens, comma-separated."""
    if experts is None:
        return {}
    numbers = (experts.experts, *experts.held, *experts.weight_bytes)
    counts = (",".join(map(str, experts.last_forward)), ",".join(map(str, experts.total)))
    return dict(zip(_EXPERT_INTS, map(str, numbers), strict=True)) | dict(
        zip(("expert_tokens_last", "expert_tokens_total"), counts, strict=True)
    )


def read_experts(raw: Mapping[str, str]) -> ExpertLoad | None:
    """The expert load a worker hash holds; None without one (a dense model, an engine without
    experts) and for one that is not sane, logged and counted: the rest of the record stands, as
    nothing places requests by it (``parse_experts`` says what is checked)."""
    if "experts_per_layer" not in raw:
        return None
    try:
        return parse_experts(raw)
    except (KeyError, ValueError) as exc:
        log.warning("ignoring the expert load of worker %.80r: %.200s", raw.get("worker_id", "?"), exc)
        metrics.REGISTRY_ROWS_REJECTED.labels("experts").inc()
        return None


def parse_experts(raw: Mapping[str, str]) -> ExpertLoad:
    """``EXPERT_FIELDS`` of a worker hash, strictly; KeyError or ValueError naming the field when
    one is missing, out of its range, or the held range is not within the model's experts, or a
    list of counts is not one count in [0, 2⁶³−1] per held expert (its length checked before it
    is split: a forged one may hold megabytes)."""
    per_layer, first, end, dense, own = (parse_int(raw[name], name) for name in _EXPERT_INTS)
    if not first < end <= per_layer:
        raise ValueError(f"experts [{first}, {end}) are not a range of the model's {per_layer}")
    last, total = (_counts(raw[name], name, end - first) for name in ("expert_tokens_last", "expert_tokens_total"))
    return ExpertLoad(per_layer, (first, end), last, total, (dense, own))


def _counts(text: str, name: str, held: int) -> tuple[int, ...]:
    """One count per held expert, comma-separated (``expert_hash``)."""
    if len(text) > 20 * held or _COUNTS.fullmatch(text) is None:
        raise ValueError(f"{name} must be {held} comma-separated counts, got {text!r:.40}")
    counts = tuple(map(int, text.split(",")))
    if len(counts) != held or max(counts) > MAX_COUNTER:
        raise ValueError(f"{name} must be {held} counts in [0, {MAX_COUNTER}], got {len(counts)}")
    return counts


@dataclass(frozen=True)
class Standing:
    """What ``up``'s autoscaler reads of one of its workers (``worker_standings``)."""

    registered: bool
    """It holds its lease: it has started (a worker still loading its model has none yet)."""
    held: int
    """Requests it holds (``running`` + ``waiting`` in its hash): the one holding least drains first."""


def worker_standings(client: redis.Redis, keys: Keys, worker_ids: Sequence[str]) -> list[Standing]:
    """Whether each worker holds its lease and what it holds, in ``worker_ids``' order, on a sync
    client, in one round trip for them all (``up``'s watch waits on it: a Redis that hangs costs
    one socket timeout, not one per worker). A field that is not a count in range reads as none
    (it only orders the drains)."""
    if not worker_ids:
        return []
    pipe = client.pipeline(transaction=False)
    for worker_id in worker_ids:
        pipe.exists(keys.lease(worker_id))
        pipe.hmget(keys.worker(worker_id), ["running", "waiting"])
    replies = pipe.execute()
    return [_standing(leases, values) for leases, values in zip(replies[::2], replies[1::2], strict=True)]


def _standing(leases: object, values: Sequence[object]) -> Standing:
    held = sum(_held_count(value, name) for value, name in zip(values, ("running", "waiting"), strict=True))
    return Standing(bool(leases), held)


def _held_count(value: object, name: str) -> int:
    try:
        return parse_int(text(cast(bytes, value)) if value is not None else "0", name)
    except (ValueError, UnicodeDecodeError):
        return 0


def reserved(values: Mapping[str, int]) -> Reserved:
    """The reservations of ``values`` (every ``Reserved`` field), none below zero: a negative sum
    (a worker that gave back more than schedulers added, or a forged one) counts as none."""
    return Reserved(*[max(values[name], 0) for name in _RESERVED_FIELDS])


@dataclass(frozen=True)
class Snapshot:
    """A registry snapshot, and what a view needs to follow the registry log from it."""

    workers: list[WorkerInfo]
    server_ms: int
    """The Redis server's clock as it read the registry."""
    log_id: str
    """The registry log's last entry then ("0-0": none): the changes after it are not in it."""


@dataclass(frozen=True)
class WorkerInfo:
    """One row of a registry snapshot."""

    record: WorkerRecord
    heartbeat_ms: int
    lease_ttl_ms: int
    """Remaining lease time; -2 when the lease is gone (the worker is dead)."""
    reserved: Reserved = field(default_factory=Reserved)

    @property
    def alive(self) -> bool:
        return self.lease_ttl_ms > 0

    @property
    def placeable(self) -> bool:
        """Alive and not draining: a worker new tasks may go to. A draining one is still alive (it
        finishes what it holds, and the reaper must not take its tasks), but is placed nothing."""
        return self.alive and not self.record.load.draining


class Registry:
    def __init__(self, redis: aioredis.Redis, config: BusConfig) -> None:
        self._redis = redis
        self._keys = config.keys
        self._keep_s = config.dead_worker_keep_s
        self._heartbeat = _HEARTBEAT.register(redis)
        self._snapshot = _SNAPSHOT.register(redis)
        self._known: list[str] = []
        """The workers of the last snapshot: the next one passes their keys to the script."""

    @property
    def log_key(self) -> str:
        """The registry log, ``sb:registry:{cell}`` (views follow it)."""
        return self._keys.registry_log

    async def register(self, record: WorkerRecord, lease_ms: int) -> int:
        """Publish the whole record and take the lease. Returns the server time (ms). A worker
        back under the id of a dead or stopped one keeps its keys: their expiry is lifted."""
        now_ms = await self._beat(record.worker_id, record.to_hash(), lease_ms)
        pipe = self._redis.pipeline(transaction=False)
        # A worker without experts under the id of one with them (a restart with another model)
        # must not show that one's: the hash keeps any field not written again.
        stale = EXPERT_FIELDS if record.load.experts is None else ()
        pipe.hdel(self._keys.worker(record.worker_id), "state", *stale)
        for key in self._own_keys(record.worker_id):
            pipe.persist(key)
        await pipe.execute()
        return now_ms

    def _own_keys(self, worker_id: str) -> tuple[str, str, str]:
        return self._keys.worker(worker_id), self._keys.tasks(worker_id), self._keys.ctrl(worker_id)

    async def heartbeat(self, worker_id: str, load: WorkerLoad, lease_ms: int) -> int:
        """Renew the lease and publish the current load. Returns the server time (ms)."""
        return await self._beat(worker_id, load_hash(load), lease_ms)

    async def snapshot(self) -> list[WorkerInfo]:
        """Every registered worker, alive or not, in ``sb:workers:{cell}`` order (``snapshot_at``)."""
        return (await self.snapshot_at()).workers

    async def snapshot_at(self) -> Snapshot:
        """Every registered worker, alive or not, in ``sb:workers:{cell}`` order, with the server's
        time and the registry log's last entry as of the read: one round trip (one script,
        atomic) while the set of workers is the one of the last snapshot; workers new since then
        are read in a second round trip (see docs/bus.md, "Worker registry")."""
        reply = await self._snapshot(keys=self._snapshot_keys(), args=self._known)
        listed, rows, (seconds, micros), last = cast(SnapshotReply, reply)
        ids = [text(worker_id) for worker_id in listed]
        found = {text(worker_id): (ttl, pairs(flat, strict=True)) for worker_id, ttl, flat in rows}
        found.update(await self._read_new([w for w in ids if w not in found]))
        self._known = ids
        server_ms = int(seconds) * 1000 + int(micros) // 1000
        return Snapshot(self._infos(ids, found), server_ms, text(last[0][0]) if last else "0-0")

    def _snapshot_keys(self) -> list[str]:
        """The snapshot script's KEYS: the cell's set and log, then the record and lease of each
        worker the last snapshot listed (the script builds no key name)."""
        known = [key for worker_id in self._known for key in self._record_and_lease(worker_id)]
        return [self._keys.workers, self._keys.registry_log, *known]

    def _infos(self, ids: list[str], found: dict[str, tuple[int, dict[bytes, bytes]]]) -> list[WorkerInfo]:
        """The rows of the listed workers that were read, in their order, less those not sane."""
        return [info for info in (self._info(w, *found[w]) for w in ids if w in found) if info is not None]

    def _record_and_lease(self, worker_id: str) -> tuple[str, str]:
        return self._keys.worker(worker_id), self._keys.lease(worker_id)

    async def _read_new(self, worker_ids: list[str]) -> dict[str, tuple[int, dict[bytes, bytes]]]:
        """Records and leases of workers the snapshot script was not given keys for; one that
        left between the two reads (no record now) is not in the result."""
        if not worker_ids:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.pttl(self._keys.lease(worker_id))
            pipe.hgetall(self._keys.worker(worker_id))
        replies = await pipe.execute()
        pairs = zip(worker_ids, replies[::2], replies[1::2], strict=True)
        return {worker_id: (ttl, record) for worker_id, ttl, record in pairs if record}

    @staticmethod
    def _info(worker_id: str, ttl: int, raw: dict[bytes, bytes]) -> WorkerInfo | None:
        """The snapshot's row of one worker; None (the worker left out, counted) when its record
        is partial, foreign or has a field out of range."""
        try:
            return Registry.row(ttl, raw)
        except ROW_ERRORS as exc:
            log.warning("skipping unreadable registry record %s: %.200s", worker_id, exc)
            metrics.REGISTRY_ROWS_REJECTED.labels("snapshot").inc()
            return None

    async def mark_dead(self, worker_id: str) -> None:
        """A worker whose tasks were taken over: out of the live set, its reservations zeroed,
        its record (``state`` = dead), task and control streams kept ``dead_worker_keep_s`` so
        operators can see what happened, then gone (worker ids carry a pid: every restart is a
        new id, and nothing else would ever delete them)."""
        key = self._keys.worker(worker_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.zrem(self._keys.workers, worker_id)
        pipe.delete(self._keys.lease(worker_id))
        pipe.hset(key, mapping={"state": "dead", **{f.name: "0" for f in dataclasses.fields(Reserved)}})
        self._expire_own(pipe, worker_id)
        self._log(pipe, worker_id, LogOp.GONE)
        await pipe.execute()

    async def is_dead(self, worker_id: str) -> bool:
        """Whether a reaper marked the worker dead (``mark_dead``) and its record is still kept."""
        return self.dead(await self._redis.hget(self._keys.worker(worker_id), "state"))

    def queue_dead(self, pipe: Pipeline, worker_id: str) -> None:
        """Add ``is_dead``'s read to a pipeline that goes out anyway; its reply is for ``dead``."""
        pipe.hget(self._keys.worker(worker_id), "state")

    @staticmethod
    def dead(reply: object) -> bool:
        """A ``queue_dead`` reply: the record's ``state`` is ``dead``."""
        return reply == b"dead"

    def queue_endpoint_and_lease(self, pipe: Pipeline, worker_id: str) -> None:
        """Add two reads to a pipeline that goes out anyway: the worker's registered transfer
        endpoint (its reply is for ``endpoint``), then whether it holds its lease (truthy)."""
        pipe.hget(self._keys.worker(worker_id), "transfer_endpoint")
        pipe.exists(self._keys.lease(worker_id))

    @staticmethod
    def endpoint(reply: object) -> str:
        """A registered transfer endpoint from a ``queue_endpoint_and_lease`` reply; "" if there
        is none, or it is not one (not a string, or longer than any endpoint a reservation may
        name, so it could match none)."""
        if not isinstance(reply, bytes) or len(reply) > MAX_ENDPOINT_BYTES:
            return ""
        return reply.decode(errors="replace")

    async def deregister(self, worker_id: str) -> None:
        """Remove a worker that is shutting down cleanly (its lease and record go at once; its
        streams expire after ``dead_worker_keep_s``, unless it comes back under the same id)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.delete(self._keys.lease(worker_id), self._keys.worker(worker_id))
        pipe.zrem(self._keys.workers, worker_id)
        self._expire_own(pipe, worker_id)
        self._log(pipe, worker_id, LogOp.GONE)
        await pipe.execute()

    async def resign(self, worker_id: str) -> None:
        """Give up the lease of a worker that stops holding work (a crash, or a stop mid-request):
        it stays in the live set without a lease, so a reaper's next pass takes it as dead and
        moves its tasks, instead of their waiting for their deadlines."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.delete(self._keys.lease(worker_id))
        self._log(pipe, worker_id, LogOp.RESIGN)
        await pipe.execute()

    def _expire_own(self, pipe: Pipeline, worker_id: str) -> None:
        for key in self._own_keys(worker_id):
            pipe.expire(key, self._keep_s)

    async def _beat(self, worker_id: str, fields: dict[str, str], lease_ms: int) -> int:
        if lease_ms < 1:
            raise ValueError("lease_ms must be >= 1")
        keys = [self._keys.worker(worker_id), self._keys.lease(worker_id), self._keys.workers, self._keys.registry_log]
        logged = [name for name in fields if name not in EXPERT_FIELDS]  # the log leaves the expert load out
        order = [*logged, *(name for name in fields if name in EXPERT_FIELDS)]
        flat = [item for name in order for item in (name, fields[name])]
        return int(await self._heartbeat(keys=keys, args=[worker_id, lease_ms, len(logged), *flat]))

    @staticmethod
    def row(ttl: int, record: Mapping[bytes, bytes]) -> WorkerInfo:
        """One worker's row from its lease's PTTL and its hash as stored (``HGETALL`` without
        decoding), every field checked (``WorkerRecord.from_hash``); one of ``ROW_ERRORS``, naming
        the field, when the record is empty, partial, not UTF-8 or has a field out of range. The
        snapshot and ``splitbus status`` read rows through it alike."""
        if not record:
            raise ValueError("empty record")
        try:
            raw = {name.decode(): value.decode() for name, value in record.items()}
        except UnicodeDecodeError:
            raw = dict(_decoded(name, value) for name, value in record.items())  # to name the field
        heartbeat_ms = parse_int(raw.get("heartbeat_ms", "0"), "heartbeat_ms")
        held = reserved(load_fields(raw, _RESERVED_FIELDS, "0"))
        return WorkerInfo(WorkerRecord.from_hash(raw), heartbeat_ms, int(ttl), held)

    async def report_load(self, worker_id: str, load: WorkerLoad, taken: Reserved | None = None) -> None:
        """Publish the load between heartbeats, and give back the reservations of the tasks it
        now counts (``taken``). One round trip, the load first: a snapshot may count a task
        twice for an instant, never not at all (schedulers would pile work on the worker)."""
        pipe = self._redis.pipeline(transaction=False)
        given = {name: -amount for name, amount in dataclasses.asdict(taken or Reserved()).items() if amount}
        self.queue_load(pipe, worker_id, load, given)
        for name, amount in given.items():
            pipe.hincrby(self._keys.worker(worker_id), name, amount)
        await pipe.execute()

    async def show_draining(self, worker_id: str, load: WorkerLoad) -> bool:
        """Whether the worker's hash holds the draining flag now (read fresh); when it does not,
        writes ``load`` (which carries the flag) again and says no: a beat or load report built
        before the flag was set may have written 0 after it, and the dispatch script reads the hash."""
        if await self._redis.hget(self._keys.worker(worker_id), "draining") == b"1":
            return True
        await self.report_load(worker_id, load)
        return False

    async def leases(self, worker_ids: list[str]) -> list[bool]:
        """Whether each worker holds its lease now (one pipeline of ``EXISTS``)."""
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.exists(self._keys.lease(worker_id))
        return [bool(n) for n in await pipe.execute()]

    async def forward_ends(self, worker_ids: list[str]) -> list[int]:
        """The ``forward_ends_ms`` the workers announced last (0: none), read fresh: a registry
        view's last change may be older than a decode step."""
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.hget(self._keys.worker(worker_id), "forward_ends_ms")
        return [_forward_end(reply) for reply in await pipe.execute()]

    def queue_load(
        self, pipe: Pipeline, worker_id: str, load: WorkerLoad, reserved_change: dict[str, int] | None = None
    ) -> None:
        """Add the load's write to a pipeline that goes out anyway (a DP rank's step plan), and its
        entry in the registry log, with the change to its ``reserved_*`` fields that the pipeline
        makes too (``+<field>``)."""
        fields = {name: str(getattr(load, name)) for name in LOAD_FIELDS}
        hashed = fields | expert_hash(load.experts)
        pipe.hset(self._keys.worker(worker_id), mapping={k: v for k, v in hashed.items()})  # typed as hset wants
        change = {change_field(name): str(amount) for name, amount in (reserved_change or {}).items()}
        self._log(pipe, worker_id, LogOp.LOAD, {**fields, **change})

    def _log(self, pipe: Pipeline, worker_id: str, op: LogOp, fields: dict[str, str] | None = None) -> None:
        """Add a registry-log entry to ``pipe`` (views apply it: ``splitbus.bus.registry_view``)."""
        entry = codec.flat({LOG_WORKER: worker_id, LOG_OP: op.value, **(fields or {})})
        pipe.xadd(self._keys.registry_log, for_xadd(entry), maxlen=LOG_MAXLEN, approximate=True)


def _forward_end(reply: bytes | None) -> int:
    """A ``forward_ends`` reply; 0 (none announced) for none or a value out of range."""
    try:
        return parse_int(reply.decode(errors="replace"), "forward_ends_ms") if reply else 0
    except ValueError:
        metrics.REGISTRY_ROWS_REJECTED.labels("field").inc()
        return 0


def _decoded(name: bytes, value: bytes) -> tuple[str, str]:
    """One field of a worker hash as text; ValueError naming it when it is not UTF-8."""
    try:
        return name.decode(), value.decode()
    except UnicodeDecodeError:
        raise ValueError(f"{name.decode(errors='replace')!r:.40} is not UTF-8") from None


class SchedulerLease:
    """A scheduler replica's lease, ``sb:scheduler-lease:{cell}:<name>``: a string set with ``PX`` by
    the replica's heartbeat, expired by Redis on its own clock. Replicas have no record to
    publish, so the lease is all there is; the ``schedulers`` group's consumer list says which
    replicas exist."""

    def __init__(self, redis: aioredis.Redis, config: BusConfig, name: str, lease_ms: int) -> None:
        if lease_ms < 1:
            raise ValueError("lease_ms must be >= 1")
        self._redis, self._keys = redis, config.keys
        self.name, self.lease_ms = name, lease_ms

    async def renew(self) -> bool:
        """Take or renew the lease; returns whether it was still held (False: it had lapsed, or
        this is the first)."""
        before = await self._redis.set(self._keys.scheduler_lease(self.name), "1", px=self.lease_ms, get=True)
        return before is not None

    async def release(self) -> None:
        """A replica stopping cleanly: the others take what it leaves pending at once."""
        await self._redis.delete(self._keys.scheduler_lease(self.name))

    async def held(self, names: list[str]) -> list[bool]:
        """Whether each named replica's lease exists (one pipeline; one key per command)."""
        if not names:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.exists(self._keys.scheduler_lease(name))
        return [bool(n) for n in await pipe.execute()]
