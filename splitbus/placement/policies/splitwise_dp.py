"""splitwise_dp: splitwise placement over prefill and decode DP groups (EP + PD), rank by rank.

Each request prefills on one prefill rank and decodes on one decode rank (``pd_placements``);
single workers of either role count as today, ranks of a DP group only while their group is
complete (``splitbus/placement/groups.py``: the decode balance and the prefill levels). With
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
from enum import Enum

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Registry, WorkerInfo
from splitbus.bus.roles import Role
from splitbus.placement.costs import choose, prefill_cost
from splitbus.placement.decision import Admitted, Decision, NoPlacement, Placed, Waiting
from splitbus.placement.fairness import priority_of
from splitbus.placement.groups import UnitsCache, decode_rank, fill_group, pd_placements, prefill_unit
from splitbus.placement.ledger import Local, reserve
from splitbus.placement.policies import register
from splitbus.placement.policies.base import PlacingContext, Policy, PolicyOptions
from splitbus.placement.prefixes import NO_PREFIXES, Prefixes
from splitbus.placement.stagger import RELEASE_LEAD_S, StaggerWindow, group_boundary_s


class Hold(Enum):
    """What becomes of a staggered arrival that is not placed at once."""

    HELD = "held"
    """In its prefill group's window, until the window closes."""
    QUEUED = "queued"
    """In the waiting queue, where ``place`` decides it."""


@register("splitwise_dp")
class SplitwiseDpPolicy(Policy):
    def __init__(self, options: PolicyOptions | None = None, prefixes: Prefixes = NO_PREFIXES) -> None:
        super().__init__(options, prefixes)
        self.units = UnitsCache()
        self.windows: dict[str, StaggerWindow[Waiting]] = {}
        """Windows by prefill group, open or not (a window keeps its group's recent arrivals)."""
        self.held_tokens: dict[str, int] = {}
        """The prompt tokens each open window holds: part of its group's level."""
        self._batches = itertools.count()

    def place(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Decision:
        decode = self._decode(request, workers, local)
        ranks = self.units(workers, request.model, Role.PREFILL).ranks
        cost = prefill_cost(ranks, request, self.cached(request, ranks), local, self.options.cost)
        prefill = choose(ranks, cost, self.rng)
        if prefill is None or decode is None:
            missing = Role.PREFILL if prefill is None else Role.DECODE
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
            batch = self.place_batch(group, self._release(group), context.view.workers, scratch)
            queue += batch.queue
            placed += batch.placed
        dues = [due for window in self.windows.values() if (due := window.due_at()) is not None]
        return Admitted(queue, placed, wake_at=min(dues, default=None))

    async def _hold(
        self, arrivals: list[Waiting], context: PlacingContext, scratch: Local
    ) -> tuple[list[Waiting], list[tuple[Waiting, Placed]]]:
        """Each arrival into its prefill group's window, or placed at once on a single prefill
        worker; returns what joins the queue and what was placed."""
        queue: list[Waiting] = []
        placed: list[tuple[Waiting, Placed]] = []
        for waiting in arrivals:
            outcome = await self._hold_one(waiting, context, scratch)
            if isinstance(outcome, Placed):
                placed.append((waiting, outcome))
            elif outcome is Hold.QUEUED:
                queue.append(waiting)
        return queue, placed

    async def _hold_one(self, waiting: Waiting, context: PlacingContext, scratch: Local) -> Placed | Hold:
        """The arrival's placement when it went to a single prefill worker, else whether it is
        held in a window or joins the queue (not a request, no prefill group for its model, no
        decode room)."""
        request = waiting.delivery.message
        if not isinstance(request, GenerateRequest):
            return Hold.QUEUED
        workers = context.view.workers
        prefill = self.units(workers, request.model, Role.PREFILL)
        if not prefill.groups:
            return Hold.QUEUED  # no window to hold it in: ``place`` decides, as splitwise does
        unit = prefill_unit(prefill, self.held_tokens, scratch, self.rng)
        if isinstance(unit, str):
            window = self.windows.setdefault(unit, StaggerWindow(max_wait_s=self.options.stagger_max_wait_s))
            if window.opened_at is None:
                window.open(waiting.since, await group_boundary(context.registry, prefill.groups[unit]))
            window.add(waiting, waiting.since)
            self.held_tokens[unit] = self.held_tokens.get(unit, 0) + len(request.prompt_token_ids)
            return Hold.HELD
        return Hold.QUEUED if unit is None else self._pair(request, unit, workers, scratch)

    def _release(self, group: str) -> list[Waiting]:
        self.held_tokens.pop(group, None)
        return self.windows[group].release(priority_of)

    def place_batch(self, group: str, batch: list[Waiting], workers: Sequence[WorkerInfo], local: Local) -> Admitted:
        """Water-fill a prefill group's held requests over its ranks, each with a decode rank; what
        finds no rank (the group broke meanwhile) or no decode rank joins the queue. ``local`` gets
        the placed requests' reservations."""
        ranks = self.units(workers, _request(batch[0]).model, Role.PREFILL).groups.get(group, [])
        chosen = fill_group(
            {w.delivery.entry_id: _request(w) for w in batch},
            ranks,
            local,
            lambda request: self.cached(request, ranks),
            self.options.cost,
        )
        pairs = self._with_decode_ranks(batch, chosen, workers, local)
        batch_id = f"{self.options.replica}.{next(self._batches)}"
        batch_ranks = len({p.record.worker_id for _, p, _ in pairs})
        placed = [(w, Placed(pd_placements(_request(w), p, d, batch_id, batch_ranks))) for w, p, d in pairs]
        kept = {id(w) for w, _, _ in pairs}
        return Admitted([w for w in batch if id(w) not in kept], placed)

    def _with_decode_ranks(
        self, batch: list[Waiting], chosen: dict[str, WorkerInfo], workers: Sequence[WorkerInfo], local: Local
    ) -> list[tuple[Waiting, WorkerInfo, WorkerInfo]]:
        """Each held request the group's ranks took, with its prefill and decode ranks, its load
        reserved in ``local``; those with no decode rank are left out."""
        pairs: list[tuple[Waiting, WorkerInfo, WorkerInfo]] = []
        for waiting in batch:
            prefill = chosen.get(waiting.delivery.entry_id)
            decode = None if prefill is None else self._decode(_request(waiting), workers, local)
            if prefill is not None and decode is not None:
                reserve(local, pd_placements(_request(waiting), prefill, decode))
                pairs.append((waiting, prefill, decode))
        return pairs

    def _decode(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> WorkerInfo | None:
        return decode_rank(request, self.units(workers, request.model, Role.DECODE), local, self.rng)

    def _pair(
        self, request: GenerateRequest, prefill: WorkerInfo, workers: Sequence[WorkerInfo], local: Local
    ) -> Placed | Hold:
        """A request placed at once on a single prefill worker, or QUEUED (no decode rank has room)."""
        decode = self._decode(request, workers, local)
        if decode is None:
            return Hold.QUEUED
        placed = Placed(pd_placements(request, prefill, decode))
        reserve(local, placed.placements)
        return placed


async def group_boundary(registry: Registry, ranks: list[WorkerInfo]) -> float:
    """When the group's running step ends, less ``RELEASE_LEAD_S`` (this process's monotonic
    clock), from what its ranks announced, read fresh (as ``stagger.next_boundary`` reads it for
    mixed groups): in the past when the group is not stepping."""
    ends = await registry.forward_ends([r.record.worker_id for r in ranks])
    return time.monotonic() + group_boundary_s({"group": ends}) - time.time() - RELEASE_LEAD_S


def _request(waiting: Waiting) -> GenerateRequest:
    request = waiting.delivery.message
    assert isinstance(request, GenerateRequest), "only requests are held"
    return request
