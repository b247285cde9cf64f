"""The dispatch protocol: one script that acks a request (or a dead worker's task), marks it
dispatched, reserves the chosen workers' load and XADDs every task, atomically. What to write
(which workers, which phases) is the scheduler's; this module owns the script and its keys.

Every dispatch draws a hand-off id, carried by its tasks and kept as the request's current one
(``sb:current:{cell}:<request>``). A prefill worker sends its KV only to the reservation made for its
own dispatch, and a redispatch (the reaper moving a dead worker's task) is written only while
the task's dispatch is still the current one: a request whose prefill worker and decode worker
both die is moved once, not once per worker (twice would give it two live dispatches).

A crash before the script leaves the request pending (another replica claims it); after it,
everything is written. A retried call finds the entry acked and does nothing, and a duplicate
request entry (a retried XADD by an API node) finds the request's hand-off id (or the dispatched
mark) and is only acked: each request is dispatched exactly once while it runs. The hand-off id
lives as long as the request (below), so a copy read however late finds it; the mark covers the
short time after the API deleted it, and a copy later still runs for nobody (its client has the
answer). A redispatch whose hand-off id is gone is the move of a finished request: only acked.

The script first checks that the entry is still pending with the calling replica (``XPENDING``
on that one id and consumer): a replica that hung (SIGSTOP, a GC pause, a frozen VM) while
holding entries has lost them to another replica once its lease expired, and when it wakes its
dispatch writes nothing (``DispatchOutcome.NOT_OURS``). ``XACK`` alone would not do: it acks an
entry whatever consumer owns it, so the woken replica would dispatch an entry that the claimer
still holds (the claimer's later dispatch would find it acked, so still one dispatch, but two
replicas would act on one request: one could fail it with a 503 while the other dispatched it).

The script writes nothing (RECOVERING) while the server is a run the cell has not settled on
(``sb:run:{cell}``, ``splitbus.bus.runs``): after a restart or failover that may have lost the
latest writes, the workers first re-assert the dispatches they hold, so that a request whose
dispatch was lost but runs on a worker is not dispatched a second time.

Keys (every one in KEYS, built in ``keys.py``): the stream the entry is acked in, the
dispatched mark, ``sb:current:{cell}:<request>``, ``sb:run:{cell}``, the registry log (each
reservation is logged there for the registry views), then per task the worker's hash, task
stream and lease. A task is written only for a worker whose lease exists as the script
runs (else WORKER_GONE): a placement made from a registry view read before the lease expired is
made again, so no request is placed on a worker after its lease has expired. Likewise for a worker
whose hash says it is draining (else WORKER_DRAINING): a view that does not show the flag yet
places nothing on it once the worker has written the flag.

Both strings are per request, so both are kept no longer than their purpose needs (under load,
what each finished request leaves is what Redis holds). The mark only has to outlive the moment a
duplicate entry of the request is dispatched (the caller's window: seconds, see
``SchedulerConfig.dispatched_ttl_s``); a redispatch's mark never matters, since its entry is
acked first. The hand-off id must outlive the request itself: the API's result reader deletes
it once it has the request's final entry (``CurrentDispatch.forget``), and its TTL runs to the
request's deadline, when nothing acts on the request any more (the scheduler fails it, workers
drop it), and one mark window more, for a request whose final entry nobody read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from splitbus.bus.core import codec
from splitbus.bus.core.batching import Batcher
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import SCHEDULER_GROUP, WORKER_GROUP, Keys
from splitbus.bus.core.scripts import LuaScript, declare, lua_string
from splitbus.bus.messages import Task
from splitbus.bus.messages.tasks import RequestJson, task_json
from splitbus.bus.registry import LOG_MAXLEN, LOG_OP, LOG_WORKER, RESERVED_FIELDS, LogOp, change_field


class DispatchOutcome(IntEnum):
    """What the ``dispatch`` script did (its reply, decoded in ``DispatchScript.write``)."""

    DISPATCHED = 1
    """The entry is acked, the request marked dispatched and every task written."""
    ALREADY_ACKED = 0
    """The entry was acked already (a retried call, with no ``consumer`` to check): nothing written."""
    DUPLICATE = -1
    """The request is dispatched already (its hand-off id, or another's dispatched mark, exists):
    the entry is only acked."""
    STALE = -2
    """A redispatch of a task that is no longer its request's current dispatch (the request moved
    already, off its other worker): the task is only acked."""
    RECOVERING = -3
    """The server is a run the cell has not settled on (a restart or failover that may have lost
    writes, ``splitbus.bus.runs``): nothing is written, the entry stays pending; dispatch again once
    the cell is settled."""
    WORKER_GONE = -4
    """A chosen worker's lease is gone (it died, or was stopped, after the registry view the placement
    was made from was read): nothing is written, the entry stays pending; place it again. No task is
    ever written for a worker without a lease."""
    NOT_OURS = -5
    """The entry is not pending with ``consumer``: claimed by another replica, or acked already.
    Nothing is written."""
    WORKER_DRAINING = -6
    """A chosen worker is draining (its hash's ``draining`` is set: it finishes what it holds and
    takes nothing new) after the registry view the placement was made from was read: nothing is
    written, the entry stays pending; place it again. No task is written once the flag is in the
    hash, so a draining worker's task stream ends with what it must finish."""

    @property
    def label(self) -> str:
        """The ``outcome`` label of the dispatch metrics (docs/metrics.md). NOT_OURS counts as
        ``already_acked``, as it did while the script gave both one code: the label's values stay."""
        return "already_acked" if self is DispatchOutcome.NOT_OURS else self.name.lower()


PLACE_AGAIN = frozenset({DispatchOutcome.RECOVERING, DispatchOutcome.WORKER_GONE, DispatchOutcome.WORKER_DRAINING})
"""Dispatch outcomes that wrote nothing and leave the request to be placed again."""

ANY_HANDOFF = "*"
"""``replaces`` for a task written before hand-off ids: whatever dispatch is current."""

Arg = bytes | str | int
"""A script argument."""
Key = bytes | str
"""A script's key: the dispatch's are encoded once (``DispatchScript.write``)."""

MAX_HANDOFF_BYTES = 4 * 64
"""A task's hand-off id is at most 64 characters (``Task``), so at most this many bytes."""

MAX_CURRENT_TTL_S = 3600
"""The longest a request's hand-off id is kept: that of a request without a deadline (0: a
bus-level client's), or one whose deadline is further off (the dispatch script's 3600000 ms)."""

_TOKENS, _REQUESTS, _BLOCKS = map(lua_string, RESERVED_FIELDS)  # a task's ARGV holds its counts in this order
_TOKENS_CHANGE, _REQUESTS_CHANGE, _BLOCKS_CHANGE = (lua_string(change_field(name)) for name in RESERVED_FIELDS)
_W, _OP, _RESERVE = map(lua_string, (LOG_WORKER, LOG_OP, LogOp.RESERVE))
DRAINING_FIELD = "draining"
"""The worker hash's field (``WorkerLoad.draining``) the script reads: 1 once the worker drains."""
_DRAINING = lua_string(DRAINING_FIELD)

_DISPATCH = declare(
    LuaScript(
        name="dispatch",
        module=__name__,
        keys=(
            "sb:requests:{cell} | sb:tasks:{cell}:<worker>",
            "sb:dispatched:{cell}:<request>",
            "sb:current:{cell}:<request>",
            "sb:run:{cell}",
            "sb:registry:{cell}",
        ),
        repeated=("sb:worker:{cell}:<worker>", "sb:tasks:{cell}:<worker>", "sb:lease:{cell}:<worker>"),
        argv=(
            'the group, the entry id ("": a request the API dispatches itself, with no entry), the mark\'s TTL (s),'
            " the number of tasks, the consumer that must own the entry"
            ' ("": any), the new hand-off id, the hand-off id that must be current ("": none may be, a request'
            ' entry\'s; "*": any, a task written before hand-off ids), when the hand-off id expires (epoch ms:'
            " its deadline + the mark's window; 0: none; at most 1 h from now by Redis's clock); per task: its"
            " reserved prefill tokens, requests, KV blocks, its entry's `type`, `data`, `ts`, and the worker's id"
        ),
        returns=(
            "1 dispatched; 0 already acked; -1 duplicate (acked only); -2 stale (acked only);"
            " -3 recovering (the server's run is not the cell's settled one: nothing written); -4 a worker's lease is"
            " gone (nothing written); -5 not pending with the consumer (claimed by another, or acked: nothing written);"
            " -6 a worker is draining (nothing written)"
        ),
        source=f"""
local info = redis.pcall('INFO', 'server')
local run = type(info) == 'string' and string.match(info, 'run_id.(%x+)')
if run and redis.call('GET', KEYS[4]) ~= run then return -3 end
if ARGV[5] ~= '' and #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[5]) == 0 then
  return -5
end
for i = 0, tonumber(ARGV[4]) - 1 do
  if redis.call('EXISTS', KEYS[8 + 3 * i]) == 0 then return -4 end
  local draining = redis.call('HGET', KEYS[6 + 3 * i], {_DRAINING})
  if draining and draining ~= '0' then return -6 end
end
if ARGV[2] ~= '' and redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
local current = redis.call('GET', KEYS[3])
if ARGV[7] == '' then
  if current then return -1 end
elseif ARGV[7] ~= '*' and current ~= ARGV[7] then return -2 end
local mark = ARGV[2] ~= '' and ARGV[2] or ARGV[6]
if not redis.call('SET', KEYS[2], mark, 'NX', 'EX', ARGV[3]) and redis.call('GET', KEYS[2]) ~= mark then
  return -1
end
local now = redis.call('TIME')
local at = tonumber(ARGV[8])
local cap = now[1] * 1000 + math.floor(now[2] / 1000) + 3600000
if at <= 0 or at > cap then at = cap end
redis.call('SET', KEYS[3], ARGV[6], 'PXAT', string.format('%.0f', at))
for i = 0, tonumber(ARGV[4]) - 1 do
  local worker, tasks, a = KEYS[6 + 3 * i], KEYS[7 + 3 * i], 9 + 7 * i
  redis.call('HINCRBY', worker, {_TOKENS}, ARGV[a])
  redis.call('HINCRBY', worker, {_REQUESTS}, ARGV[a + 1])
  redis.call('HINCRBY', worker, {_BLOCKS}, ARGV[a + 2])
  redis.call('XADD', tasks, '*', 'type', ARGV[a + 3], 'data', ARGV[a + 4], 'ts', ARGV[a + 5])
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', {LOG_MAXLEN}, '*', {_W}, ARGV[a + 6], {_OP}, {_RESERVE},
    {_TOKENS_CHANGE}, ARGV[a], {_REQUESTS_CHANGE}, ARGV[a + 1], {_BLOCKS_CHANGE}, ARGV[a + 2])
end
return 1
""",
    )
)


class SettleOutcome(IntEnum):
    """What the ``settle_failed`` script did (its reply, decoded in ``DispatchScript.settle_failed``)."""

    FAIL_IT = 1
    """The request is not dispatched: it is marked now (no copy will be), so its client may be failed."""
    NOT_OURS = 0
    """The entry is not pending with ``consumer`` (claimed by another replica, or acked): nothing written."""
    DUPLICATE = -1
    """The request is dispatched or failed already: the entry is acked, nothing is to be written."""


_SETTLE_FAILED = declare(
    LuaScript(
        name="settle_failed",
        module=__name__,
        keys=("sb:requests:{cell}", "sb:dispatched:{cell}:<request>", "sb:current:{cell}:<request>"),
        argv=(
            'the group, the entry id ("": dead-lettered, acked already), the consumer that must own the entry'
            ' ("": any), the mark\'s TTL (s)'
        ),
        returns="1 not dispatched (marked: fail it); 0 not the consumer's; -1 dispatched or failed already (acked)",
        source="""
if ARGV[3] ~= '' and #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3]) == 0 then
  return 0
end
local mark = redis.call('GET', KEYS[2])
if redis.call('EXISTS', KEYS[3]) == 1 or (mark and mark ~= ARGV[2]) then
  if ARGV[2] ~= '' then redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) end
  return -1
end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[4])
return 1
""",
    )
)
"""Before a scheduler fails a request entry (no worker, its deadline, dead-lettered): a copy of
a request that is dispatched (a retried XADD) must not end the live run's stream with an error,
and once failed, no copy is dispatched (it finds the mark). The caller writes the error, then
acks the entry: a crash between leaves it pending, and the claimer finds its own mark."""


class ReassertOutcome(IntEnum):
    """What the ``reassert`` script did (its reply, decoded in ``Reassertion.reassert``)."""

    REASSERTED = 1
    """The task's dispatch is its request's current one (written again: the id and the mark, or it was)."""
    SUPERSEDED = 0
    """Another dispatch of the request is current (it was dispatched again meanwhile): nothing written."""
    OVER = -1
    """No hand-off id, but another's dispatched mark: the request ended (its reader deleted the id
    on its final entry) or a scheduler failed it. Nothing is written."""


REASSERT_MARK_TTL_S = 60
"""The dispatched mark a worker writes again lives this long: the scheduler's default
``dispatched_ttl_s`` (the mark outlives a duplicate request entry's window; the hand-off id,
written with it, is what a re-processed request entry finds while the request runs)."""

_REASSERT = declare(
    LuaScript(
        name="reassert",
        module=__name__,
        keys=("sb:current:{cell}:<request>", "sb:dispatched:{cell}:<request>"),
        argv=(
            "the task's hand-off id, the mark's TTL (s), when the hand-off id expires (epoch ms: the request's"
            " deadline + the mark's window; 0: none; at most 1 h from now by Redis's clock)"
        ),
        returns=(
            "1 the task's dispatch is current (written again: the id and the mark, or it was); 0 another dispatch"
            " is current; -1 no id but another's mark (the request ended or was failed): nothing written"
        ),
        source="""
local current = redis.call('GET', KEYS[1])
if current then
  if current == ARGV[1] then return 1 end
  return 0
end
local mark = redis.call('GET', KEYS[2])
if mark and mark ~= ARGV[1] then return -1 end
local now = redis.call('TIME')
local at = tonumber(ARGV[3])
local cap = now[1] * 1000 + math.floor(now[2] / 1000) + 3600000
if at <= 0 or at > cap then at = cap end
redis.call('SET', KEYS[1], ARGV[1], 'PXAT', string.format('%.0f', at))
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return 1
""",
    )
)
"""After a new Redis run (``splitbus.bus.runs``), a worker writes again the dispatch of each task
it holds, which the run may have lost with the tasks' dispatch script: a scheduler that
re-processes the request entry then finds it dispatched (a duplicate, only acked), not a request
to dispatch a second time. The mark holds the hand-off id, which no entry id equals."""


@dataclass(frozen=True)
class TaskWrite:
    """One task of a dispatch: the worker it goes to and the task (its ``reserved`` is added to
    the worker's counters)."""

    worker_id: str
    task: Task


@dataclass(frozen=True)
class Entry:
    """The entry a dispatch settles: acked in ``stream`` for ``group``, marked dispatched under
    ``mark`` (the id that makes a duplicate a duplicate)."""

    stream: str
    group: str
    entry_id: str
    mark: str


MAX_CACHED_WORKERS = 4096
"""How many workers' encoded keys a ``DispatchScript`` keeps."""

TASK_TYPE = Task.TYPE.encode()


@dataclass(frozen=True)
class _WorkerArgs:
    """A worker's keys in the script's order (its hash, task stream, lease) and its id, encoded."""

    keys: tuple[bytes, ...]
    id: bytes


def _int_arg(value: int) -> bytes:
    return str(value).encode()


class DispatchScript:
    """The dispatch script, sent in the pipeline shared with concurrent dispatches."""

    def __init__(self, redis: aioredis.Redis, config: BusConfig, dispatched_ttl_s: int) -> None:
        self._keys = config.keys
        self._script = _DISPATCH.register(redis)
        self._settle = _SETTLE_FAILED.register(redis)
        self._batcher = Batcher(redis)
        self._ttl = dispatched_ttl_s
        self._ttl_arg = str(dispatched_ttl_s).encode()
        self._control = (self._keys.run.encode(), self._keys.registry_log.encode())
        self._workers: dict[str, _WorkerArgs] = {}

    def _worker_args(self, worker_id: str) -> _WorkerArgs:
        """A worker's three keys and its id, as bytes: encoded once per worker, not per call
        (redis-py's encoder costs ~0.5 µs per ``str`` argument; issue 40). Bounded: a cell whose
        workers came and went more than ``MAX_CACHED_WORKERS`` times starts the cache again."""
        found = self._workers.get(worker_id)
        if found is None:
            if len(self._workers) >= MAX_CACHED_WORKERS:
                self._workers.clear()
            found = self._workers[worker_id] = _WorkerArgs(
                tuple(key.encode() for key in self._worker_keys(worker_id)), worker_id.encode()
            )
        return found

    def _worker_keys(self, worker_id: str) -> tuple[str, str, str]:
        return self._keys.worker(worker_id), self._keys.tasks(worker_id), self._keys.lease(worker_id)

    def request_entry(self, entry_id: str, request_id: str) -> Entry:
        """A request entry of ``sb:requests:{cell}``: dispatched once per request id."""
        return Entry(self._keys.requests, SCHEDULER_GROUP, entry_id, self._keys.dispatched(request_id))

    def direct(self, request_id: str) -> Entry:
        """A request an API node dispatches itself, with no entry to ack: dispatched once per
        request id, as a request entry is (its mark holds the dispatch's hand-off id)."""
        return Entry(self._keys.requests, SCHEDULER_GROUP, "", self._keys.dispatched(request_id))

    def task_entry(self, dead_worker: str, entry_id: str, request_id: str) -> Entry:
        """A dead worker's task: moved once per old entry (a retried call or a second reaper does
        nothing)."""
        return Entry(
            self._keys.tasks(dead_worker), WORKER_GROUP, entry_id, self._keys.dispatched(f"{request_id}:{entry_id}")
        )

    async def write(
        self,
        entry: Entry,
        request_id: str,
        handoff: str,
        tasks: Sequence[TaskWrite],
        consumer: str = "",
        replaces: str = "",
        deadline_ms: int = 0,
    ) -> DispatchOutcome:
        """Settle ``entry`` by writing ``tasks`` (which carry ``handoff``, the request's current
        one from now). ``consumer``: the entry must still be pending with it ("" for no check);
        ``replaces``: the hand-off id that must still be the request's current one ("" for a
        first dispatch, which none may be: a request dispatched already is a duplicate;
        ``ANY_HANDOFF``: a task written before hand-off ids); ``deadline_ms``: the request's (0:
        none), which bounds how long the hand-off id is kept. Returns DISPATCHED, ALREADY_ACKED,
        NOT_OURS, DUPLICATE, STALE, RECOVERING (nothing written: the cell is not settled on
        the server's run, ``splitbus.bus.runs``), WORKER_GONE (nothing written: a worker's
        lease is gone) or WORKER_DRAINING (nothing written: a worker is draining)."""
        keys = [entry.stream.encode(), entry.mark.encode(), self._keys.current(request_id).encode(), *self._control]
        args: list[Arg] = [
            entry.group.encode(),
            entry.entry_id.encode(),
            self._ttl_arg,
            str(len(tasks)).encode(),
            consumer.encode(),
            handoff.encode(),
            replaces.encode(),
            str(self.current_expiry_ms(deadline_ms)).encode(),
        ]
        requests = RequestJson()
        ts = str(codec.now_us()).encode()
        for write in tasks:
            worker = self._worker_args(write.worker_id)
            keys += worker.keys
            args += [*map(_int_arg, write.task.reserved), TASK_TYPE, task_json(write.task, requests), ts, worker.id]
        return DispatchOutcome(await self._run(keys, args, self._script))

    async def settle_failed(self, entry_id: str, request_id: str, consumer: str = "") -> SettleOutcome:
        """Whether the request of a request entry that is to be failed may be: FAIL_IT (marked
        now), NOT_OURS (with ``consumer``: the entry is not pending with it) or DUPLICATE (the
        request is dispatched or failed already: the entry is acked, nothing is to be written).
        ``entry_id`` "": a dead-lettered entry, acked already."""
        keys = [self._keys.requests, self._keys.dispatched(request_id), self._keys.current(request_id)]
        args: list[Arg] = [SCHEDULER_GROUP, entry_id, consumer, self._ttl]
        return SettleOutcome(await self._run(keys, args, self._settle))

    def current_expiry_ms(self, deadline_ms: int) -> int:
        """When the hand-off id of a request with ``deadline_ms`` expires (``current_expiry_ms``)."""
        return current_expiry_ms(deadline_ms, self._ttl)

    async def _run(self, keys: Sequence[Key], args: list[Arg], script: AsyncScript) -> int:
        """Loaded again if Redis lost it (a restart)."""
        try:
            return int(await self._batcher.call("evalsha", script.sha, len(keys), *keys, *args))
        except NoScriptError:
            return int(await script(keys=keys, args=args))


def current_expiry_ms(deadline_ms: int, mark_ttl_s: int) -> int:
    """When the hand-off id of a request with ``deadline_ms`` (epoch ms, 0: none) expires: at its
    deadline and one mark window more (0 for none). The scripts cap it at MAX_CURRENT_TTL_S from
    now by Redis's clock, and no local clock is read: a scheduler whose clock runs ahead of the
    API's does not cut the id's life short."""
    return deadline_ms + mark_ttl_s * 1000 if deadline_ms > 0 else 0


class Reassertion:
    """The ``reassert`` script, for a worker that saw a new Redis run: one call per held task."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, mark_ttl_s: int = REASSERT_MARK_TTL_S) -> None:
        self._keys = keys
        self._script = _REASSERT.register(redis)
        self._ttl = mark_ttl_s

    async def reassert(self, request_id: str, handoff: str, deadline_ms: int) -> ReassertOutcome:
        """Make the dispatch ``handoff`` its request's current one again if the request has none:
        REASSERTED (it is current now), SUPERSEDED (another is: drop the task) or OVER."""
        keys = [self._keys.current(request_id), self._keys.dispatched(request_id)]
        args: list[Arg] = [handoff, self._ttl, current_expiry_ms(deadline_ms, self._ttl)]
        return ReassertOutcome(int(await self._script(keys=keys, args=args)))


class CurrentDispatch:
    """Reads of ``sb:current:{cell}:<request>``, the hand-off id of the request's current dispatch (the
    script above writes it). The id is only compared with a task's, so it stays bytes."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys

    async def read(self, request_id: str) -> bytes | None:
        """The request's current hand-off id; None if none is known (none yet, or its TTL ran out)."""
        return self.parse(await self._redis.get(self._keys.current(request_id)))

    def queue_read(self, pipe: Pipeline, request_id: str) -> None:
        """Add the read to a pipeline that goes out anyway; its reply is for ``parse``."""
        pipe.get(self._keys.current(request_id))

    def forget(self, batcher: Batcher, request_id: str) -> asyncio.Future[Any]:
        """Delete the request's hand-off id, in ``batcher``'s next pipeline: its client has the
        final entry, so the request is over, and nothing compares the id any more (a reaper
        that finds one of its tasks later reads the stream, ended, first)."""
        return batcher.call("delete", self._keys.current(request_id))

    @staticmethod
    def parse(reply: object) -> bytes | None:
        """A GET reply as a hand-off id. A value longer than any task's id is cut just past that
        length: it still equals no task's id (so it reads as another dispatch's, as uncut), and
        no caller holds more of it. A client that decodes replies gives str: encoded back."""
        if reply is None:
            return None
        if isinstance(reply, str):
            reply = reply.encode()
        if not isinstance(reply, bytes):
            raise TypeError(f"sb:current holds a {type(reply).__name__}, not a string")
        return reply[: MAX_HANDOFF_BYTES + 1]
