"""splitwise_dp: splitwise placement over prefill and decode DP groups (EP + PD), rank by rank.

Each request prefills on one prefill rank and decodes on one decode rank (``pd_placements``);
single workers of either role count as today, ranks of a DP group only while their group is
complete (``splitbus/scheduler/groups.py``: the decode balance and the prefill levels). With
only single workers it places exactly as ``splitwise`` does.

With staggering (the default; ``--no-stagger`` turns it off) a prefill arrival bound for a
group is held in that group's window (``StaggerWindow``), which closes just before the group's
running step ends or ``stagger_max_wait_s`` after it opened; the held requests are then
water-filled over the group's ranks as one batch, so their prefills share a step. An arrival
bound for a single prefill worker is placed at once. What the batch cannot place, and each
request the scheduler claims or the reaper moves, is placed alone by ``place``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Registry, Reserved, WorkerInfo
from splitbus.scheduler.groups import UnitsCache, decode_rank, fill_group, pd_placements, prefill_unit
from splitbus.scheduler.placement import Local, Placement, Waiting, choose, prefill_cost
from splitbus.scheduler.policies import register
from splitbus.scheduler.policies.base import (
    Admitted,
    Decision,
    NoPlacement,
    Placed,
    PlacingContext,
    Policy,
    PolicyOptions,
)
from splitbus.scheduler.prefixes import NO_PREFIXES, Prefixes
from splitbus.scheduler.stagger import RELEASE_LEAD_S, StaggerWindow, group_boundary_s

Pairs = list[tuple[Waiting, Placement]]


@register("splitwise_dp")
class SplitwiseDpPolicy(Policy):
    def __init__(self, options: PolicyOptions | None = None, prefixes: Prefixes = NO_PREFIXES) -> None:
        super().__init__(options, prefixes)
        self.units = UnitsCache()
        self.windows: dict[str, StaggerWindow[Waiting]] = {}
        """Open windows, by prefill group."""
        self.held_tokens: dict[str, int] = {}
        """The prompt tokens each open window holds: part of its group's level."""
        self._batches = itertools.count()

    def place(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Decision:
        decode = self._decode(request, workers, local)
        ranks = self.units(workers, request.model, "prefill").ranks
        cost = prefill_cost(ranks, request, self.cached(request, ranks), local, self.options.cost)
        prefill = choose(ranks, cost, self.rng)
        if prefill is None or decode is None:
            missing = "prefill" if prefill is None else "decode"
            return NoPlacement(
                f"no live {missing} worker or complete {missing} group with room serves model '{request.model}'"
            )
        return Placed(pd_placements(request, prefill, decode))

    async def admit(self, arrivals: list[Waiting], context: PlacingContext) -> Admitted:
        """Arrivals bound for a prefill group wait in its window; each window that closes goes out
        as one batch, water-filled over the group's ranks."""
        if not self.options.stagger:
            return Admitted(arrivals)
        scratch = Local(context.local)  # this call's placements count for its next decisions
        queue, placed = await self._hold(arrivals, context, scratch)
        now = time.monotonic()
        for group in [g for g, window in self.windows.items() if window.ready(now)]:
            left, filled = self.place_batch(group, self._release(group), context.view.workers, scratch)
            queue += left
            placed += filled
        dues = [due for window in self.windows.values() if (due := window.due_at()) is not None]
        return Admitted(queue, placed, wake_at=min(dues, default=None))

    async def _hold(
        self, arrivals: list[Waiting], context: PlacingContext, scratch: Local
    ) -> tuple[list[Waiting], Pairs]:
        """Each arrival into its prefill group's window, or placed at once on a single prefill
        worker; returns what joins the queue and what was placed."""
        queue: list[Waiting] = []
        placed: Pairs = []
        for waiting in arrivals:
            pairs = await self._hold_one(waiting, context, scratch)
            if pairs is None:
                queue.append(waiting)
            placed += pairs or []
        return queue, placed

    async def _hold_one(self, waiting: Waiting, context: PlacingContext, scratch: Local) -> Pairs | None:
        """[] when the arrival is held in a window, its placements when it went to a single prefill
        worker, None when it joins the queue (not a request, no prefill group for its model, no
        decode room)."""
        request = waiting.delivery.message
        if not isinstance(request, GenerateRequest):
            return None
        workers = context.view.workers
        prefill = self.units(workers, request.model, "prefill")
        if not prefill.groups:
            return None  # no window to hold it in: ``place`` decides, as splitwise does
        unit = prefill_unit(prefill, self.held_tokens, scratch, self.rng)
        if isinstance(unit, str):
            window = self.windows.setdefault(unit, StaggerWindow(max_wait_s=self.options.stagger_max_wait_s))
            if window.opened_at is None:
                window.open(waiting.since, await group_boundary(context.registry, prefill.groups[unit]))
            window.add(waiting)
            self.held_tokens[unit] = self.held_tokens.get(unit, 0) + len(request.prompt_token_ids)
            return []
        return None if unit is None else self._pair(waiting, request, unit, workers, scratch)

    def _release(self, group: str) -> list[Waiting]:
        self.held_tokens.pop(group, None)
        return self.windows.pop(group).release()

    def place_batch(
        self, group: str, batch: list[Waiting], workers: Sequence[WorkerInfo], local: Local
    ) -> tuple[list[Waiting], Pairs]:
        """Water-fill a prefill group's held requests over its ranks, each with a decode rank; what
        finds no rank (the group broke meanwhile) or no decode rank joins the queue. ``local`` gets
        the placed requests' reservations."""
        ranks = self.units(workers, _request(batch[0]).model, "prefill").groups.get(group, [])
        chosen = fill_group(
            {w.delivery.entry_id: _request(w) for w in batch},
            ranks,
            local,
            lambda request: self.cached(request, ranks),
            self.options.cost,
        )
        pairs: list[tuple[Waiting, WorkerInfo, WorkerInfo]] = []
        for waiting in batch:
            prefill = chosen.get(waiting.delivery.entry_id)
            decode = None if prefill is None else self._decode(_request(waiting), workers, local)
            if prefill is not None and decode is not None:
                _reserve(local, pd_placements(_request(waiting), prefill, decode))
                pairs.append((waiting, prefill, decode))
        batch_id = f"{self.options.replica}.{next(self._batches)}"
        batch_ranks = len({p.record.worker_id for _, p, _ in pairs})
        placed = [(w, t) for w, p, d in pairs for t in pd_placements(_request(w), p, d, batch_id, batch_ranks)]
        kept = {id(w) for w, _, _ in pairs}
        return [w for w in batch if id(w) not in kept], placed

    def _decode(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> WorkerInfo | None:
        return decode_rank(request, self.units(workers, request.model, "decode"), local, self.rng)

    def _pair(
        self,
        waiting: Waiting,
        request: GenerateRequest,
        prefill: WorkerInfo,
        workers: Sequence[WorkerInfo],
        local: Local,
    ) -> Pairs | None:
        """A request placed at once on a single prefill worker, or None (no decode rank has room)."""
        decode = self._decode(request, workers, local)
        if decode is None:
            return None
        placements = pd_placements(request, prefill, decode)
        _reserve(local, placements)
        return [(waiting, p) for p in placements]


async def group_boundary(registry: Registry, ranks: list[WorkerInfo]) -> float:
    """When the group's running step ends, less ``RELEASE_LEAD_S`` (this process's monotonic
    clock), from what its ranks announced, read fresh (as ``stagger.next_boundary`` reads it for
    mixed groups): in the past when the group is not stepping."""
    ends = await registry.forward_ends([r.record.worker_id for r in ranks])
    return time.monotonic() + group_boundary_s({"group": ends}) - time.time() - RELEASE_LEAD_S


def _reserve(local: Local, placements: Sequence[Placement]) -> None:
    for p in placements:
        mine, add = local.get(p.worker.record.worker_id, Reserved()), p.reserve
        local[p.worker.record.worker_id] = Reserved(
            mine.reserved_prefill_tokens + add.reserved_prefill_tokens,
            mine.reserved_requests + add.reserved_requests,
            mine.reserved_kv_blocks + add.reserved_kv_blocks,
        )


def _request(waiting: Waiting) -> GenerateRequest:
    request = waiting.delivery.message
    assert isinstance(request, GenerateRequest), "only requests are held"
    return request
