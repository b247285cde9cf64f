"""Writing a request's tasks: one script that acks the request, marks it dispatched, reserves
the chosen workers' load and XADDs every task, atomically.

Every dispatch draws a hand-off id, carried by its tasks and kept as the request's current one
(``sb:current:{request}``). A prefill worker sends its KV only to the reservation made for its
own dispatch, and a redispatch (the reaper moving a dead worker's task) is written only while
the task's dispatch is still the current one: a request whose prefill worker and decode worker
both die is moved once, not once per worker (twice would give it two live dispatches).

A crash before the script leaves the request pending (another replica claims it); after it,
everything is written. A retried call finds the entry acked and does nothing, and a duplicate
request entry (a retried XADD by an API node) finds the dispatched mark and is only acked: each
request is dispatched exactly once.

The script first checks that the entry is still pending with the calling replica (``XPENDING``
on that one id and consumer): a replica that hung (SIGSTOP, a GC pause, a frozen VM) while
holding entries has lost them to another replica once its lease expired, and when it wakes its
dispatch writes nothing. ``XACK`` alone would not do: it acks an entry whatever consumer owns
it, so the woken replica would dispatch an entry that the claimer still holds (the claimer's
later dispatch would find it acked, so still one dispatch, but two replicas would act on one
request: one could fail it with a 503 while the other dispatched it).
"""

from __future__ import annotations

import dataclasses
import secrets

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from splitbus.bus import codec
from splitbus.bus.batching import Batcher
from splitbus.bus.config import BusConfig
from splitbus.bus.keys import SCHEDULER_GROUP, WORKER_GROUP
from splitbus.bus.messages import GenerateRequest, Task
from splitbus.bus.scheduler.policy import Placement
from splitbus.bus.scripts import LuaScript, declare

DISPATCHED = 1
ALREADY_ACKED = 0
DUPLICATE = -1
STALE = -2
"""A redispatch of a task that is no longer its request's current dispatch (the request moved
already, off its other worker): the task is only acked."""
NOT_OURS = ALREADY_ACKED
"""The entry is not pending with this consumer: acked already, or claimed by another replica."""

_DISPATCH = declare(
    LuaScript(
        name="dispatch",
        module=__name__,
        keys=("sb:requests | sb:tasks:{worker}", "sb:dispatched:{request}", "sb:current:{request}"),
        repeated=("sb:worker:{worker}", "sb:tasks:{worker}"),
        argv=(
            "the group, the entry id, the mark's TTL (s), the number of tasks, the consumer that must own the entry"
            ' ("": any), the new hand-off id, the hand-off id that must be current ("": any); per task: its'
            " reserved prefill tokens, requests, KV blocks, and its entry's `type`, `data`, `ts`"
        ),
        returns="1 dispatched; 0 already acked or not the consumer's; -1 duplicate (marked); -2 stale (acked only)",
        source="""
if ARGV[5] ~= '' and #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[5]) == 0 then
  return 0
end
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
local current = redis.call('GET', KEYS[3])
if ARGV[7] ~= '' and current and current ~= ARGV[7] then return -2 end
if not redis.call('SET', KEYS[2], ARGV[2], 'NX', 'EX', ARGV[3]) then return -1 end
redis.call('SET', KEYS[3], ARGV[6], 'EX', ARGV[3])
for i = 0, tonumber(ARGV[4]) - 1 do
  local worker, tasks, a = KEYS[4 + 2 * i], KEYS[5 + 2 * i], 8 + 6 * i
  redis.call('HINCRBY', worker, 'reserved_prefill_tokens', ARGV[a])
  redis.call('HINCRBY', worker, 'reserved_requests', ARGV[a + 1])
  redis.call('HINCRBY', worker, 'reserved_kv_blocks', ARGV[a + 2])
  redis.call('XADD', tasks, '*', 'type', ARGV[a + 3], 'data', ARGV[a + 4], 'ts', ARGV[a + 5])
end
return 1
""",
    )
)


class Dispatcher:
    def __init__(self, redis: aioredis.Redis, config: BusConfig, dispatched_ttl_s: int) -> None:
        self._keys = config.keys
        self._script = _DISPATCH.register(redis)
        self._batcher = Batcher(redis)
        self._ttl = dispatched_ttl_s

    async def dispatch(
        self, entry_id: str, request: GenerateRequest, placements: list[Placement], consumer: str = ""
    ) -> int:
        """Returns DISPATCHED, ALREADY_ACKED (NOT_OURS: with ``consumer``, the entry is not
        pending with it) or DUPLICATE. The tasks' hand-off id becomes the request's current one."""
        mark = self._keys.dispatched(request.request_id)
        return await self._write(
            self._keys.requests, SCHEDULER_GROUP, entry_id, mark, request, placements, consumer=consumer
        )

    async def redispatch(
        self,
        dead_worker: str,
        entry_id: str,
        task: Task,
        placements: list[Placement],
        first_seq: int,
        tokens: list[int],
    ) -> int:
        """Move a dead worker's task: ack it in that worker's stream and write new tasks that
        continue at ``first_seq`` after the ``tokens`` already sent; DISPATCHED, ALREADY_ACKED,
        DUPLICATE (another reaper moved this entry) or STALE (the task's dispatch is not the request's current one: it moved already, from
        the task's other worker, and only the ack is written). The mark is per old entry, so a
        retried call or a second reaper does nothing."""
        mark = self._keys.dispatched(f"{task.request.request_id}:{entry_id}")
        return await self._write(
            self._keys.tasks(dead_worker),
            WORKER_GROUP,
            entry_id,
            mark,
            task.request,
            placements,
            first_seq,
            tokens,
            replaces=task.handoff,
        )

    async def _write(
        self,
        stream: str,
        group: str,
        entry_id: str,
        mark: str,
        request: GenerateRequest,
        placements: list[Placement],
        first_seq: int = 0,
        tokens: list[int] | None = None,
        consumer: str = "",
        replaces: str = "",
    ) -> int:
        """``replaces``: the hand-off id that must still be the request's current one ("" for a
        first dispatch, or a task written before hand-off ids)."""
        handoff = secrets.token_hex(8)  # one per dispatch: P and D find each other's reservation by it
        keys = [stream, mark, self._keys.current(request.request_id)]
        args: list[object] = [group, entry_id, self._ttl, len(placements), consumer, handoff, replaces]
        for p in placements:
            worker_id = p.worker.record.worker_id
            keys += [self._keys.worker(worker_id), self._keys.tasks(worker_id)]
            reserved = list(dataclasses.astuple(p.reserve))
            task = Task(
                p.phase, request, p.peer, first_seq, list(tokens or []), p.batch_id, p.batch_ranks, reserved, handoff
            )
            fields = codec.encode(task)
            args += [*reserved, fields[b"type"], fields[b"data"], fields[b"ts"]]
        return int(await self._run(keys, args))

    async def _run(self, keys: list[str], args: list[object]) -> object:
        """The script, in the pipeline shared with concurrent dispatches; loaded again if Redis
        lost it (a restart)."""
        try:
            return await self._batcher.call("evalsha", self._script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self._script(keys=keys, args=args)
