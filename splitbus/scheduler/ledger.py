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
from collections.abc import Callable
from dataclasses import dataclass

from splitbus.bus.registry import Reserved
from splitbus.scheduler.placement import Local, Placement


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

    def reserve(self, placement: Placement) -> None:
        """Called as a decision is made, before its dispatch is written."""
        entry = _Entry(placement.worker.record.worker_id, placement.reserve)
        self._entries.append(entry)
        self._add(entry)

    def written(self) -> None:
        """Called once the dispatches of the reservations made so far have returned (written or
        not: one that wrote nothing is forgotten with the next snapshot, as an overestimate)."""
        now = self._clock()
        for entry in self._entries:
            if entry.written_at is None:
                entry.written_at = now

    def view_refreshed(self, read_at: float) -> None:
        """Called with a new snapshot, read from ``read_at`` (monotonic) on: what it shows is
        forgotten, the rest is counted again."""
        self._entries = [e for e in self._entries if e.written_at is None or e.written_at >= read_at]
        self.local.clear()
        for entry in self._entries:
            self._add(entry)

    def _add(self, entry: _Entry) -> None:
        mine, add = self.local.get(entry.worker_id, Reserved()), entry.load
        self.local[entry.worker_id] = Reserved(
            mine.reserved_prefill_tokens + add.reserved_prefill_tokens,
            mine.reserved_requests + add.reserved_requests,
            mine.reserved_kv_blocks + add.reserved_kv_blocks,
        )
