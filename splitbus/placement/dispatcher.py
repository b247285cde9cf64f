"""What a dispatch writes: one task per placement, all with one fresh hand-off id, through the
bus's dispatch script (``splitbus/bus/dispatch.py``: the protocol, its keys and its guarantees).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.dispatch import ANY_HANDOFF, DispatchOutcome, DispatchScript, SettleOutcome, TaskWrite
from splitbus.bus.messages import GenerateRequest, Task
from splitbus.bus.records import Reserved
from splitbus.placement.decision import Placement


class Dispatcher:
    def __init__(self, redis: aioredis.Redis, config: BusConfig, dispatched_ttl_s: int) -> None:
        self._script = DispatchScript(redis, config, dispatched_ttl_s)

    async def dispatch(
        self,
        entry_id: str,
        request: GenerateRequest,
        placements: Sequence[Placement],
        consumer: str = "",
        traceparent: str = "",
    ) -> DispatchOutcome:
        """Returns DISPATCHED, ALREADY_ACKED (without ``consumer``), NOT_OURS (with ``consumer``:
        the entry is not pending with it), DUPLICATE (the request is dispatched already: the entry is acked),
        RECOVERING, WORKER_GONE or WORKER_DRAINING (nothing written: place it again).
        The tasks' hand-off id becomes the request's current one; their ``traceparent`` is
        the placing span's (the request's own without one)."""
        entry = self._script.request_entry(entry_id, request.request_id)
        handoff = _handoff()
        tasks = task_writes(request, placements, handoff, traceparent=traceparent)
        return await self._script.write(
            entry, request.request_id, handoff, tasks, consumer=consumer, deadline_ms=request.deadline_ms
        )

    async def dispatch_direct(self, request: GenerateRequest, placements: Sequence[Placement]) -> DispatchOutcome:
        """Write the tasks of a request that has no entry (an API node places it itself:
        ``splitbus api --dispatch api``); DISPATCHED, DUPLICATE (dispatched already),
        RECOVERING, WORKER_GONE or WORKER_DRAINING (nothing written: the caller submits it to the schedulers)."""
        handoff = _handoff()
        tasks = task_writes(request, placements, handoff)
        entry = self._script.direct(request.request_id)
        return await self._script.write(entry, request.request_id, handoff, tasks, deadline_ms=request.deadline_ms)

    async def redispatch(
        self,
        dead_worker: str,
        entry_id: str,
        task: Task,
        placements: Sequence[Placement],
        first_seq: int,
        tokens: list[int],
        traceparent: str = "",
    ) -> DispatchOutcome:
        """Move a dead worker's task: ack it in that worker's stream and write new tasks that
        continue at ``first_seq`` after the ``tokens`` already sent; DISPATCHED, ALREADY_ACKED,
        DUPLICATE (another reaper moved this entry) or STALE (the task's dispatch is not the
        request's current one: it moved already, from the task's other worker, and only the ack
        is written). The mark is per old entry, so a retried call or a second reaper does
        nothing."""
        request = task.request
        entry = self._script.task_entry(dead_worker, entry_id, request.request_id)
        handoff = _handoff()
        tasks = task_writes(request, placements, handoff, first_seq, tokens, traceparent)
        # replaces: the hand-off id that must still be the request's current one (none left: the
        # request ended, STALE); a task written before hand-off ids has none to compare
        replaces = task.handoff or ANY_HANDOFF
        return await self._script.write(
            entry, request.request_id, handoff, tasks, replaces=replaces, deadline_ms=request.deadline_ms
        )

    async def settle_failed(self, entry_id: str, request_id: str, consumer: str = "") -> SettleOutcome:
        """Before failing a request entry: FAIL_IT (the request is not dispatched, and now no copy
        will be), NOT_OURS, or DUPLICATE (it is dispatched or failed already: acked, write
        nothing). ``entry_id`` "": a dead-lettered entry."""
        return await self._script.settle_failed(entry_id, request_id, consumer)


def _handoff() -> str:
    """One per dispatch: P and D find each other's reservation by it."""
    return secrets.token_hex(8)


def task_writes(
    request: GenerateRequest,
    placements: Sequence[Placement],
    handoff: str,
    first_seq: int = 0,
    tokens: Sequence[int] = (),
    traceparent: str = "",
) -> list[TaskWrite]:
    """One task per placement, each carrying ``handoff`` (and, for a moved task, where its
    output continues)."""
    return [
        TaskWrite(
            p.worker.record.worker_id,
            Task(
                p.phase,
                request,
                p.peer,
                first_seq,
                list(tokens),
                p.batch_id,
                p.batch_ranks,
                _counts(p.reserve),
                handoff,
                p.twins,
                traceparent or request.traceparent,
            ),
        )
        for p in placements
    ]


def _counts(reserve: Reserved) -> list[int]:
    """A task's ``reserved`` (``RESERVED_FIELDS``' order). Not ``dataclasses.astuple``: it deep-copies
    each field, 3 µs a task of a decision's ~200 µs (``bench scheduler``, issue 40)."""
    return [reserve.reserved_prefill_tokens, reserve.reserved_requests, reserve.reserved_kv_blocks]
