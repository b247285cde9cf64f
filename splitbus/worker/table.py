"""The requests a worker holds: one entry per request, with one status (nano-vllm's
``SequenceStatus``), in one table. No Redis here: what to write when a request changes status is
the core's (``splitbus.worker.core``), which owns the table and answers with effects.

A request leaves the table when it leaves the worker (finished, failed, handed off, moved,
cancelled); its task is acked at the next publish. Within a status, requests keep the order they
reached it in: the running ones decode in arrival order. Queued prefills go by the request's
priority (lower first, as vLLM's ``--scheduling-policy priority``), then in the order they
reached QUEUED (``prefill_queue``): the scheduler dispatches as soon as a worker has KV blocks, so under load the
queue that a high-priority request waits in is this one, and it must not wait behind every
lower-priority request queued here before it.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from splitbus.worker.sequence import Sequence, kv_tokens
from splitbus.worker.twins import NO_FORKS, Forks


class Status(enum.Enum):
    QUEUED = "queued"
    """Taken, its blocks reserved: to prefill (prefill and mixed tasks)."""
    PREFILLING = "prefilling"
    """In the engine's prefill step now."""
    AWAITING_KV = "awaiting_kv"
    """A decode task: blocks reserved in ``sb:kv``, waiting for its prefill worker's cache."""
    IMPORTING = "importing"
    """A decode task whose KV frame came: the engine takes the cache into its blocks now. Not
    droppable: what takes it out of the table (its request moved here again) leaves the blocks
    to the import, which lets the task go when it ends."""
    RUNNING = "running"
    """Decoding, one token per step."""
    HANDING_OFF = "handing_off"
    """Prefilled on a prefill worker: its cache on its way to the decode worker."""


HELD = (Status.QUEUED, Status.AWAITING_KV, Status.IMPORTING, Status.RUNNING, Status.HANDING_OFF)
"""What counts against ``max_requests``: a batch in the engine's prefill step does not (the load
is reported without it while it runs)."""
DROPPABLE = (Status.QUEUED, Status.AWAITING_KV, Status.RUNNING)
"""What a cancel or a passed deadline takes out at once: a prefill, a hand-off or an import in
flight finds out itself when it ends (it checks that its request is still its own)."""


@dataclass
class _Entry:
    seq: Sequence
    status: Status
    kv_deadline: float = 0.0
    """While AWAITING_KV: the monotonic time its KV must have come by."""


class RequestTable:
    """The core's (``WorkerCore.table``); the shell's parts read it, from the one event loop.
    The core adds what a task comes to, moves requests through prefill and decode, holds those
    that ship or import their KV, and whatever ends a request (a finish, a cancel, a deadline,
    a move) takes it out. Each method says who calls it when."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, seq: Sequence, status: Status, kv_deadline: float = 0.0) -> None:
        """A request comes in (or back, after its prefill). Its older task, if any, must have
        left first: one request has one entry.

        Called when a task is taken (QUEUED; a decode task AWAITING_KV), after a prefill
        (RUNNING on a mixed worker, HANDING_OFF on a prefill worker) and once an import ends
        (RUNNING)."""
        if seq.request_id in self._entries:
            raise ValueError(f"{seq.request_id} is held already ({self._entries[seq.request_id].status.value})")
        self._entries[seq.request_id] = _Entry(seq, status, kv_deadline)

    def move(self, seq: Sequence, status: Status) -> None:
        """``seq`` changes status; it goes to the end of its new status's order. Called when a
        prefill batch starts and when a KV frame's import starts (AWAITING_KV -> IMPORTING)."""
        if self.status(seq) is None:
            raise KeyError(f"{seq.request_id}: this task is not held")
        del self._entries[seq.request_id]
        self._entries[seq.request_id] = _Entry(seq, status)

    def status(self, seq: Sequence) -> Status | None:
        """The status of this very task (None if it is not held: another task of its request is).
        Asked after an await by whoever holds ``seq``: is it still its own?"""
        entry = self._entries.get(seq.request_id)
        return entry.status if entry is not None and entry.seq is seq else None

    def holds(self, seq: Sequence, *statuses: Status) -> bool:
        """Whether this very task is held (with one of ``statuses``): asked by the hand-off and
        the engine's steps after each await, before they write for it."""
        return self.status(seq) in (statuses or tuple(Status))

    def get(self, request_id: str, *statuses: Status) -> Sequence | None:
        """The request's task if it has one of ``statuses`` (any if none): asked by the receiver
        for a KV frame (AWAITING_KV) and by the task feed before it fails a dead-lettered task's
        request (not one it holds)."""
        entry = self._entries.get(request_id)
        return entry.seq if entry is not None and entry.status in (statuses or tuple(Status)) else None

    def remove(self, seq: Sequence) -> bool:
        """``seq`` leaves; False if it was not held (a newer task of its request stays). Called by
        whatever ends it: a finished decode, a poison, a failed or let-go hand-off or import, a
        move, a deadline, a broken DP group. The caller retires it (``WorkerCore.retire``)."""
        if self.status(seq) is None:
            return False
        del self._entries[seq.request_id]
        return True

    def take(self, request_id: str, *statuses: Status) -> Sequence | None:
        """Remove and return the request's task if it has one of ``statuses`` (any status if none).
        Called for a cancel, with ``DROPPABLE``."""
        seq = self.get(request_id, *statuses)
        if seq is not None:
            del self._entries[request_id]
        return seq

    def of(self, *statuses: Status) -> list[Sequence]:
        """The tasks with these statuses (all if none), in order: a snapshot, safe to change the
        table while going through it. Asked for each decode batch, a DP rank's plan, a deadline
        pass, a task feed's look for what moved away."""
        return [e.seq for e in self._select(statuses)]

    def count(self, *statuses: Status) -> int:
        """How many tasks have these statuses (all if none): for the load, ``max_requests`` and
        whether the engine loop has work."""
        return sum(1 for _ in self._select(statuses))

    def kv_deadline(self, seq: Sequence) -> float:
        """When an AWAITING_KV task's KV must have come (monotonic; 0 in any other status)."""
        return self._entries[seq.request_id].kv_deadline if self.holds(seq, Status.AWAITING_KV) else 0.0

    def prefill_queue(self) -> list[Sequence]:
        """The QUEUED requests in the order they are prefilled: by priority (lower first), then in
        the order they reached QUEUED (a stable sort: a batch whose prefill was aborted, queued
        again at the front, is first again within its priority). Sorted once per plan: the
        table may hold thousands."""
        return sorted(self.of(Status.QUEUED), key=_priority)

    def next_prefill(self) -> Sequence | None:
        """The first of ``prefill_queue`` (None if none is queued), found without sorting: a DP
        rank's plan names its batch and how long it has waited."""
        return min(self.of(Status.QUEUED), key=_priority, default=None)  # the first of the least: stable

    def prefill_batch_size(self, max_tokens: int, forks: Forks = NO_FORKS) -> tuple[int, int]:
        """How many queued requests the next prefill batch takes (the first of ``prefill_queue``
        first, at least one), and their tokens: as many as fit in ``max_tokens``, a twin that
        waits or shares a forward counting none (``forks``). Asked by a DP rank that announces
        how long its prefill will take (``WorkerCore.prefill_batch_size``); ``start_prefill``
        plans the same batch from the same order."""
        return _batch_size(self.prefill_queue(), max_tokens, forks)

    def start_prefill(
        self,
        max_tokens: int,
        first_to_compute: Callable[[Sequence], int | None] = lambda _: None,
        reserve: Callable[[Sequence, int], bool] = lambda _, __: True,
        forks: Forks = NO_FORKS,
    ) -> list[Sequence]:
        """The next prefill batch, now PREFILLING. Called by the engine's prefill step, before the
        engine call. A sequence whose ``first_to_compute`` block (``Engine.first_to_compute``) an
        earlier one of the batch computes too is left QUEUED: a step later it finds the block
        cached instead of computing it again (siblings sharing a prefix arrive together). Each
        other one without blocks yet is given its KV blocks (``reserve``: ``Engine.reserve``, for
        its prompt and first token, with the prefix cache's blocks as they are then); the first
        that gets none ends the batch, and waits, first in line (``prefill_queue``: the requests
        of a lower priority do not pass it), for a request to leave. Twins
        (``forks``, ``splitbus.worker.twins``) still waiting for their response's other choices
        stay QUEUED; one whose twin is in the batch already joins it forked from that one. The
        engine's functions are passed in, not the core's: the core calls the table, never the
        other way round."""
        queue = self.prefill_queue()
        count, _ = _batch_size(queue, max_tokens, forks)
        batch: list[Sequence] = []
        computing: set[int] = set()
        for seq in queue[:count]:
            if forks.waits(seq):
                continue
            if forks.fork(seq):
                batch.append(seq)
                self.move(seq, Status.PREFILLING)
                continue
            block = first_to_compute(seq)
            if block is not None and block in computing:
                continue
            if not (seq.blocks > 0 or reserve(seq, kv_tokens(seq.task))):
                break
            if block is not None:
                computing.add(block)
            forks.lead(seq)
            batch.append(seq)
            self.move(seq, Status.PREFILLING)
        return batch

    def end_prefill(self) -> list[Sequence]:
        """Remove and return what is still PREFILLING (a request that moved meanwhile is not).
        Called once the engine's prefill call has ended; the caller adds each back as it goes on."""
        return self._take_all(e for e in self._select((Status.PREFILLING,)))

    def abort_prefill(self) -> list[Sequence]:
        """The prefill did not end (Redis refused during it, or the worker stops): what is still
        PREFILLING is QUEUED again, first in line within its priority (``prefill_queue``), to be
        prefilled again (its blocks kept)."""
        batch = {e.seq.request_id: _Entry(e.seq, Status.QUEUED) for e in self._select((Status.PREFILLING,))}
        self._entries = {**batch, **{rid: e for rid, e in self._entries.items() if rid not in batch}}
        return [e.seq for e in batch.values()]

    def kv_waits_past(self, now: float) -> list[Sequence]:
        """Remove and return the requests whose KV has not come by its deadline. Called by the
        engine loop before each step (``WorkerCore.kv_waits_past``)."""
        return self._take_all(e for e in self._select((Status.AWAITING_KV,)) if now > e.kv_deadline)

    def _select(self, statuses: tuple[Status, ...]) -> Iterable[_Entry]:
        return [e for e in self._entries.values() if not statuses or e.status in statuses]

    def _take_all(self, entries: Iterable[_Entry]) -> list[Sequence]:
        taken = [e.seq for e in entries]
        for seq in taken:
            del self._entries[seq.request_id]
        return taken


_request_priority: Callable[[Sequence], int] = operator.attrgetter("task.request.priority")


def _priority(seq: Sequence) -> float:
    """What orders ``prefill_queue`` before arrival: the request's ``GenerateRequest.priority`` (an
    int, checked as the task was decoded), except that a request already holding KV blocks (a
    batch whose prefill was aborted, a twin whose batch failed) goes first: when blocks are short,
    a request of an earlier priority that gets none would otherwise wait for those blocks to be
    freed by requests queued behind it, for ever (an attrgetter reads the priority: on 5,000
    queued requests it sorts them in about 0.3 ms)."""
    return -math.inf if seq.blocks > 0 else _request_priority(seq)


def _batch_size(queue: list[Sequence], max_tokens: int, forks: Forks) -> tuple[int, int]:
    """The requests and tokens of the prefill batch taken from the front of ``queue``
    (``RequestTable.prefill_batch_size``)."""
    count = tokens = 0
    leaders: dict[Hashable, Sequence] = {}
    for seq in queue:
        uncached = forks.cost(seq, leaders)
        if count and tokens + uncached > max_tokens:
            break
        count, tokens = count + 1, tokens + uncached
    return count, tokens
