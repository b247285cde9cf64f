"""The candidates of one role, as columns: what ``splitwise`` and ``mixed`` decide on.

A registry snapshot serves many decisions (the view gives the same list until a change), so the
load of each ``(model, role)``'s live workers is read out of the rows once per snapshot into
numpy columns (``LoadTable``), and a decision is a few array operations over them plus the
reservations this replica made since the previous decision (``Local`` journals them): not a
Python loop over every candidate and every reservation, which at 128 candidates a role cost
~0.3 ms a decision (docs/benchmarks.md, "Placement by columns").

The rules are ``costs``'s, and so are the random picks: ``pick`` draws from the same
candidates, in the same order, with the same ``random.Random`` calls as ``costs.choose``, so a
seeded policy decides alike either way (``tests/placement/test_columns.py`` checks it).

Policies import this module when they are made, not when the CLI lists them: numpy takes a third
of a second to import, which every ``splitbus`` command would pay.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.records import Reserved
from splitbus.bus.registry import WorkerInfo
from splitbus.placement.costs import NEAR, CacheCost, eligible
from splitbus.placement.ledger import Local
from splitbus.placement.prefixes import Candidates

Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Loads:
    """A table's load with this replica's reservations since the snapshot taken off."""

    free: Ints
    """Free KV blocks, less the reserved ones (``costs.free_blocks``)."""
    queued: Ints
    """Queued prefill tokens, reserved ones included (``costs.queued_prefill``)."""
    active: Ints
    """Running, waiting and reserved requests (``costs.active_requests``)."""


_NONE = Reserved()


def _minus(a: Reserved, b: Reserved) -> Reserved:
    return Reserved(
        a.reserved_prefill_tokens - b.reserved_prefill_tokens,
        a.reserved_requests - b.reserved_requests,
        a.reserved_kv_blocks - b.reserved_kv_blocks,
    )


@dataclass
class _Kept:
    """A table's columns with a ``Local``'s reservations applied, as of its journal's ``seen``
    first entries."""

    local: Local
    epoch: int
    seen: int
    loads: Loads
    applied: dict[str, Reserved]
    """What is applied, by worker: a change applies the difference."""


class LoadTable:
    """The live workers of one role serving one model in one snapshot, in snapshot order."""

    def __init__(self, workers: Sequence[WorkerInfo]) -> None:
        self.workers = list(workers)
        self.index = {w.record.worker_id: i for i, w in enumerate(self.workers)}
        self.candidates = Candidates.of(self.workers)
        ws = self.workers
        self.block_size = _column([w.record.block_size for w in ws])
        self.total = _column([w.record.load.total_kv_blocks for w in ws])
        self.first_priority = _column([w.record.load.first_queued_priority for w in ws])
        """The priority first in each worker's prefill queue (``WorkerLoad.first_queued_priority``)."""
        self._base = Loads(
            _column([w.record.load.free_kv_blocks - w.reserved.reserved_kv_blocks for w in ws]),
            _column([w.record.load.queued_prefill_tokens + w.reserved.reserved_prefill_tokens for w in ws]),
            _column([w.record.load.running + w.record.load.waiting + w.reserved.reserved_requests for w in ws]),
        )
        self._kept: _Kept | None = None

    def __len__(self) -> int:
        return len(self.workers)

    def every(self) -> Ints:
        """Every row, in order."""
        return np.arange(len(self.workers))

    def loads(self, local: Mapping[str, Reserved]) -> Loads:
        """The columns less ``local``'s reservations on these workers. From a ``Local``, the
        columns of the last call follow its journal: O(changes since), and the arrays returned
        are valid until the next call. From any other mapping, copies: O(len(local))."""
        if not isinstance(local, Local):
            return self._apply(self._copy(), local.items())
        kept = self._kept
        if kept is None or kept.local is not local or kept.epoch != local.epoch:
            kept = self._kept = _Kept(local, local.epoch, 0, self._copy(), {})
        new = local.journal[kept.seen :]
        changes = []
        for worker in new:
            if worker in self.index:
                load = local[worker]
                before = kept.applied.get(worker, _NONE)
                kept.applied[worker] = load
                changes.append((worker, _minus(load, before)))
        kept.seen += len(new)
        return self._apply(kept.loads, changes)

    def update(self, worker: WorkerInfo) -> bool:
        """Take a newer row of one of its workers, still live in this role and model (a new
        snapshot changed it); False when the table cannot (its block size changed: build anew)."""
        i = self.index[worker.record.worker_id]
        if worker.record.block_size != self.block_size[i]:
            return False
        self.workers[i] = worker
        load, held = worker.record.load, worker.reserved
        self.first_priority[i] = load.first_queued_priority
        change = (
            load.free_kv_blocks - held.reserved_kv_blocks - self._base.free[i],
            load.queued_prefill_tokens + held.reserved_prefill_tokens - self._base.queued[i],
            load.running + load.waiting + held.reserved_requests - self._base.active[i],
        )
        self.total[i] = load.total_kv_blocks
        for loads in (self._base, self._kept.loads if self._kept else None):
            if loads is not None:  # the kept columns move by as much as the base
                loads.free[i] += change[0]
                loads.queued[i] += change[1]
                loads.active[i] += change[2]
        return True

    def _copy(self) -> Loads:
        return Loads(self._base.free.copy(), self._base.queued.copy(), self._base.active.copy())

    def _apply(self, loads: Loads, changes: Iterable[tuple[str, Reserved]]) -> Loads:
        for worker, r in changes:
            i = self.index.get(worker)
            if i is not None:
                loads.free[i] -= r.reserved_kv_blocks
                loads.queued[i] += r.reserved_prefill_tokens
                loads.active[i] += r.reserved_requests
        return loads

    def open_queues(self, rows: Ints, loads: Loads, bound: int, priority: int) -> Ints:
        """``rows`` whose queued prefill tokens are under ``bound`` (all of them when it is 0), or
        under twice it for a request of an earlier priority than the first in the worker's queue
        (it would head it): a worker with a longer queue takes no more until it has prefilled
        some, but one that would go first waits no longer here. Twice, not unbounded: the first
        priority is the worker's last report, which does not know what was placed since, so a
        flood of an earlier priority would pass for ever (``PolicyOptions.max_queued_prefill_tokens``)."""
        if bound <= 0:
            return rows
        queued = loads.queued[rows]
        return rows[(queued < bound) | ((queued < 2 * bound) & (self.first_priority[rows] > priority))]

    def roomy(self, request: GenerateRequest, loads: Loads) -> Ints:
        """The rows with free KV blocks for the request's prompt and output
        (``costs.roomy``), in order."""
        tokens = len(request.prompt_token_ids) + request.sampling.max_tokens
        needs = -(-tokens // np.maximum(self.block_size, 1))  # ceil, as blocks_needed
        return np.flatnonzero(loads.free >= needs)


def _column(values: list[int]) -> Ints:
    return np.array(values, dtype=np.int64)


class Tables:
    """``LoadTable`` per ``(model, role)``, following the snapshots.

    A registry view rebuilds only the rows that changed and keeps each worker's position
    (``RegistryView.workers``), so a new snapshot is compared with the last one row by row (an
    identity check each) and only the changed rows are taken into the tables; a table whose
    membership changed (a worker joined, died, or changed role or model) is built anew, and so
    is every table when the workers themselves changed (a snapshot with another list of ids) or
    most rows did."""

    def __init__(self) -> None:
        self._snapshot: Sequence[WorkerInfo] = ()
        self._rows: tuple[WorkerInfo, ...] = ()
        """The snapshot's rows as they were: a caller may change a list it passed before."""
        self._tables: dict[tuple[str, str], LoadTable] = {}

    def __call__(self, workers: Sequence[WorkerInfo], model: str, role: str) -> LoadTable:
        if workers is not self._snapshot:
            self._follow(workers)
            self._snapshot, self._rows = workers, tuple(workers)
        key = (model, role)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = LoadTable(eligible(workers, model, role))
        return table

    def _follow(self, workers: Sequence[WorkerInfo]) -> None:
        changed = self._changed_rows(workers)
        if changed is None:
            self._tables = {}
            return
        for old, new in changed:
            self._take(old, new)

    def _changed_rows(self, workers: Sequence[WorkerInfo]) -> list[tuple[WorkerInfo, WorkerInfo]] | None:
        """The rows ``workers`` changed since the last snapshot, as (old, new); None when every
        table is built anew instead: there are none yet, the workers are others, or most rows
        changed."""
        before = self._rows
        if len(before) != len(workers) or not self._tables:
            return None
        changed = [(old, new) for old, new in zip(before, workers, strict=True) if old is not new]
        if len(changed) > len(workers) // 4 or any(o.record.worker_id != n.record.worker_id for o, n in changed):
            return None
        return changed

    def _take(self, old: WorkerInfo, new: WorkerInfo) -> None:
        """Take a worker's newer row into its table."""
        was, now = _key(old), _key(new)
        if was != now:  # the worker joined or left a table: both are built anew
            for key in (was, now):
                if key is not None:
                    self._tables.pop(key, None)
        elif now in self._tables and not self._tables[now].update(new):
            del self._tables[now]


def _key(worker: WorkerInfo) -> tuple[str, str] | None:
    """The table a worker is a row of (None: none, it is dead or draining: placed nothing)."""
    return (worker.record.model, worker.record.role) if worker.placeable else None


def pick(rows: Ints, costs: Floats | Ints, rng: random.Random) -> int | None:
    """A random row among ``rows`` whose cost (``costs[k]`` for ``rows[k]``) is within NEAR of
    the lowest (``costs.choose``); None when there are no rows."""
    if len(rows) == 0:
        return None
    best = costs.min()
    bound = best + abs(best) * NEAR
    near: list[int] = rows[costs <= bound].tolist()
    return rng.choice(near)


def decode_row(table: LoadTable, loads: Loads, request: GenerateRequest, rng: random.Random) -> int | None:
    """The row to decode on: the most free KV blocks (within NEAR), then the fewest active
    requests (``costs.decode_worker``); None when none has blocks for the request."""
    room = table.roomy(request, loads)
    free = loads.free[room]
    most_free = pick(room, -free, rng)
    if most_free is None:
        return None
    floor = int(loads.free[most_free])
    tied = free >= floor - abs(floor) * NEAR
    return pick(room[tied], loads.active[room[tied]], rng)


def prefill_costs(
    table: LoadTable, loads: Loads, rows: Ints, request: GenerateRequest, cached: dict[str, int], cost: CacheCost
) -> Floats:
    """``costs.prefill_cost`` of each of ``rows`` (ascending): queued prefill tokens plus the prompt, less
    ``overlap_weight`` per cached prompt token unless the row's queue is more than
    ``load_cap_tokens`` over the least loaded of ``rows``."""
    queued = loads.queued[rows]
    costs = (queued + len(request.prompt_token_ids)).astype(np.float64)
    if not cached or len(rows) == 0:
        return costs
    floor = int(queued.min())
    for worker, tokens in cached.items():  # the few holders of the prompt's first block
        row = table.index.get(worker)
        k = int(np.searchsorted(rows, row)) if row is not None else len(rows)
        if k < len(rows) and rows[k] == row and int(queued[k]) - floor <= cost.load_cap_tokens:
            costs[k] -= cost.overlap_weight * tokens
    return costs


def mixed_costs(
    table: LoadTable, loads: Loads, rows: Ints, request: GenerateRequest, cached: dict[str, int], cost: CacheCost
) -> Floats:
    """``costs.mixed_cost`` of each of ``rows``: the prefill cost in blocks plus the KV blocks
    the row's requests hold."""
    used = table.total[rows] - loads.free[rows]
    return prefill_costs(table, loads, rows, request, cached, cost) / table.block_size[rows] + used
