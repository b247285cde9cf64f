"""stagger: the DP policy that holds arrivals and releases them as one batch spread over the ranks
(``splitbus scheduler --mode dp``, the default there; see ``splitbus/placement/stagger.py`` for
why). Each request it cannot place in its batch, and each one the scheduler claims from another
replica or the reaper moves, is placed alone as ``dp`` places it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Registry, WorkerInfo
from splitbus.bus.registry_view import RegistryView
from splitbus.bus.roles import Role
from splitbus.placement.costs import (
    blocks_needed,
    credit,
    dp_placement,
    dp_ranks,
    free_blocks,
    queued_prefill,
    reserved,
)
from splitbus.placement.decision import Admitted, Placed, Waiting
from splitbus.placement.fairness import priority_of
from splitbus.placement.ledger import Local
from splitbus.placement.policies import register
from splitbus.placement.policies.base import PlacingContext, PolicyOptions
from splitbus.placement.policies.dp import DpPolicy
from splitbus.placement.prefixes import NO_PREFIXES, Prefixes
from splitbus.placement.stagger import RELEASE_LEAD_S, Job, RankLoad, StaggerWindow, group_boundary_s, water_fill


@register("stagger")
class StaggerPolicy(DpPolicy):
    def __init__(self, options: PolicyOptions | None = None, prefixes: Prefixes = NO_PREFIXES) -> None:
        super().__init__(options, prefixes)
        self.window: StaggerWindow[Waiting] = StaggerWindow(max_wait_s=self.options.stagger_max_wait_s)
        self._batches = itertools.count()

    async def admit(self, arrivals: list[Waiting], context: PlacingContext) -> Admitted:
        """Arrivals wait in the window; once it closes they go out as one batch."""
        if arrivals and self.window.opened_at is None:
            self.window.open(arrivals[0].since, await next_boundary(context.view, context.registry))
        for waiting in arrivals:
            self.window.add(waiting, waiting.since)
        if not self.window.ready(time.monotonic()):
            return Admitted([], wake_at=self.window.due_at())
        return self.place_batch(self.window.release(priority_of), context.view.workers, context.local)

    def place_batch(self, batch: list[Waiting], workers: Sequence[WorkerInfo], local: Local) -> Admitted:
        """Water-fill the batch over the DP ranks, model by model; what it cannot place (and
        what is not a request) joins the queue."""
        queue = [w for w in batch if not isinstance(w.delivery.message, GenerateRequest)]
        placed: list[tuple[Waiting, Placed]] = []
        for model, group in _by_model(batch).items():
            filled, left = self._fill(group, dp_ranks(workers, model), local)
            placed += filled
            queue += left
        return Admitted(queue, placed)

    def _fill(
        self, group: list[Waiting], ranks: list[WorkerInfo], local: Local
    ) -> tuple[list[tuple[Waiting, Placed]], list[Waiting]]:
        """One model's requests over its ranks: the placed ones, and those left."""
        if not ranks:
            return [], group
        by_id = {r.record.worker_id: r for r in ranks}
        loads = [
            RankLoad(rid, queued_prefill(r, reserved(local, r)), free_blocks(r, reserved(local, r)))
            for rid, r in by_id.items()
        ]
        block_size = ranks[0].record.block_size
        jobs = {w.delivery.entry_id: w for w in group}
        sizes = [
            Job(
                k,
                len(_request(w).prompt_token_ids),
                blocks_needed(_request(w), block_size),
                self.cached(_request(w), ranks),
                _request(w).priority,
            )
            for k, w in jobs.items()
        ]
        placed = water_fill(sizes, loads, credit(self.options.cost))
        batch_id, batch_ranks = f"{self.options.replica}.{next(self._batches)}", len(set(placed.values()))
        filled = [
            (jobs[key], Placed((dp_placement(by_id[rank_id], _request(jobs[key]), batch_id, batch_ranks),)))
            for key, rank_id in placed.items()
        ]
        return filled, [w for key, w in jobs.items() if key not in placed]


async def next_boundary(view: RegistryView, registry: Registry) -> float:
    """When the first mixed DP group's running step ends, less ``RELEASE_LEAD_S`` (this process's
    monotonic clock), from what its ranks announced; read fresh, as a registry snapshot is
    older than a decode step. The ranks' wall clocks are taken to agree with this one to
    within a few ms, as NTP keeps them."""
    by_group: dict[str, list[int]] = {}
    ranks = [w for w in view.live() if w.record.dp_size > 0 and w.record.role == Role.MIXED]  # not P or D groups
    for rank, end_ms in zip(ranks, await registry.forward_ends([r.record.worker_id for r in ranks]), strict=True):
        by_group.setdefault(rank.record.dp_group, []).append(end_ms)
    return time.monotonic() + group_boundary_s(by_group) - time.time() - RELEASE_LEAD_S


def _by_model(batch: list[Waiting]) -> dict[str, list[Waiting]]:
    by_model: dict[str, list[Waiting]] = {}
    for w in batch:
        if isinstance(w.delivery.message, GenerateRequest):
            by_model.setdefault(w.delivery.message.model, []).append(w)
    return by_model


def _request(waiting: Waiting) -> GenerateRequest:
    request = waiting.delivery.message
    assert isinstance(request, GenerateRequest), "only requests are batched"
    return request
