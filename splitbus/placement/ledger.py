"""This replica's reservations that its registry view does not show yet.

A dispatch adds its load to the chosen workers' ``reserved_*`` counters in Redis, and the next
registry snapshot shows it; until then the replica counts it itself (``Local``, what policies
read), so that its next decisions see it. A snapshot shows exactly the dispatches written before
it was read: a reservation may be forgotten only once its dispatch had returned before that
read began. Forgetting every reservation at each new snapshot (as before) lost those written
while the snapshot was on its way, and under load a worker got more requests than it had KV
blocks for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from splitbus.bus.records import Reserved
from splitbus.placement.decision import Placement

JOURNAL_SLACK = 64
"""Entries a ``Local``'s journal may hold beyond four per worker before it starts over."""


class Local(dict[str, Reserved]):
    """This replica's reservations since the registry snapshot, by worker id: what policies read,
    what its ``Ledger`` keeps.

    It journals the workers set since it last started over, so that what is derived from it (a
    ``LoadTable``'s columns, ``placement/columns.py``) follows each change instead of reading every
    entry at every decision. A change the journal does not record (a removal, ``clear``) starts it
    over: ``epoch`` goes up and the journal lists every worker again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0
        self.journal: list[str] = list(self)

    def __setitem__(self, worker: str, load: Reserved) -> None:
        super().__setitem__(worker, load)
        self.journal.append(worker)
        if len(self.journal) > 4 * len(self) + JOURNAL_SLACK:
            self._start_over()

    def __delitem__(self, worker: str) -> None:
        super().__delitem__(worker)
        self._start_over()

    def update(self, *args: Any, **kwargs: Any) -> None:
        for worker, load in dict(*args, **kwargs).items():
            self[worker] = load

    def setdefault(self, worker: str, load: Reserved | None = None) -> Reserved:
        if worker not in self:
            self[worker] = load or Reserved()
        return self[worker]

    def pop(self, worker: str, *default: Any) -> Any:
        try:
            return super().pop(worker, *default)
        finally:
            self._start_over()

    def popitem(self) -> tuple[str, Reserved]:
        try:
            return super().popitem()
        finally:
            self._start_over()

    def clear(self) -> None:
        super().clear()
        self._start_over()

    def __ior__(self, other: Any) -> Local:  # type: ignore[override,misc]
        self.update(other)
        return self

    def copy(self) -> Local:
        return Local(self)

    def __reduce__(self) -> tuple[type[Local], tuple[dict[str, Reserved]]]:
        # copy, deepcopy and pickle make a Local with a journal of its own (the default would share it)
        return (type(self), (dict(self),))

    def _start_over(self) -> None:
        self.epoch += 1
        self.journal = list(self)


@dataclass
class _Entry:
    worker_id: str
    load: Reserved
    written_at: float | None = None
    """When its dispatch returned (monotonic); None while it is in flight."""


class Ledger:
    """Keeps ``local`` (the mapping policies are given) equal to the reservations not yet in the
    registry view."""

    def __init__(self, local: Local, clock: Callable[[], float] = time.monotonic) -> None:
        self.local = local
        self._clock = clock
        self._entries: list[_Entry] = []
        self._in_flight: list[_Entry] = []
        """The entries not stamped ``written`` yet: an API node calls ``written`` after each
        request's write, and a walk of every entry since the snapshot each time made a decision's
        cost grow with the load (90 µs at 256 concurrent writes, ``bench scheduler``, issue 40)."""

    def reserve(self, placement: Placement) -> None:
        """Called as a decision is made, before its dispatch is written."""
        entry = _Entry(placement.worker.record.worker_id, placement.reserve)
        self._entries.append(entry)
        self._in_flight.append(entry)
        self._add(entry)

    def written(self) -> None:
        """Called once the dispatches of the reservations made so far have returned (written or
        not: one that wrote nothing is forgotten with the next snapshot, as an overestimate)."""
        now = self._clock()
        for entry in self._in_flight:
            entry.written_at = now
        self._in_flight = []

    def view_refreshed(self, read_at: float) -> None:
        """Called with a new snapshot, read from ``read_at`` (monotonic) on: what it shows is
        forgotten, the rest is counted again."""
        self._entries = [e for e in self._entries if e.written_at is None or e.written_at >= read_at]
        self.local.clear()
        for entry in self._entries:
            self._add(entry)

    def _add(self, entry: _Entry) -> None:
        _add(self.local, entry.worker_id, entry.load)


def reserve(local: Local, placements: Iterable[Placement]) -> None:
    """Count the placements' load in ``local`` (a policy's scratch copy: its next decisions in one
    batch see it)."""
    for p in placements:
        _add(local, p.worker.record.worker_id, p.reserve)


def _add(local: Local, worker_id: str, add: Reserved) -> None:
    mine = local.get(worker_id, Reserved())
    local[worker_id] = Reserved(
        mine.reserved_prefill_tokens + add.reserved_prefill_tokens,
        mine.reserved_requests + add.reserved_requests,
        mine.reserved_kv_blocks + add.reserved_kv_blocks,
    )
