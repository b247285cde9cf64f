"""The routing-policy interface: what the scheduler asks a policy, and when.

A policy decides where a request's tasks go, from a registry snapshot and this replica's own
reservations since it was read. Each scheduler replica makes one policy at start-up
(``policies.create``); its scheduling loop and its reaper share it (with prefill queues bounded,
the reaper has one of its own without the bound: ``Scheduler._moves_policy``). They call it
from one event loop, under the scheduler's placing lock or between the reaper's awaits, so a
policy needs no lock of its own.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Registry, WorkerInfo
from splitbus.bus.registry_view import RegistryView
from splitbus.placement.costs import CacheCost
from splitbus.placement.decision import Admitted, Decision, Waiting
from splitbus.placement.disagg import Disaggregation
from splitbus.placement.ledger import Local
from splitbus.placement.prefixes import NO_PREFIXES, Candidates, Prefixes


@dataclass(frozen=True)
class PolicyOptions:
    """What a policy is made with (``policies.create``); a policy reads the fields it uses."""

    replica: str = "scheduler"
    """The scheduler replica's consumer name: batch ids start with it, so they are unique."""
    stagger_max_wait_s: float = 0.5
    """stagger, splitwise_dp: the longest an arrival is held (``SchedulerConfig.stagger_max_wait_s``)."""
    stagger: bool = True
    """splitwise_dp: hold prefill arrivals per prefill group and release them as batches (False:
    place each at once). The dp policies have one policy per choice (``dp``, ``stagger``)."""
    rng: random.Random | None = None
    """The source of the random pick among equally loaded candidates (None: a fresh one)."""
    cost: CacheCost = CacheCost()
    """How a worker's cached prompt tokens weigh against its load (docs/routing.md, "The cost")."""
    disagg: Disaggregation = Disaggregation()
    """splitwise: when a request prefills on its decode worker (off by default)."""
    max_queued_prefill_tokens: int = 0
    """splitwise, mixed: a worker is given a request to prefill only while its queued prefill
    tokens (reported and reserved) are under this; 0: no bound. What finds every queue full waits
    in the scheduler's queue, in its order (priority, then tenants' fair share), until a worker
    has room or its deadline passes (``NoPlacement.busy``; docs/tenants.md, "Where requests wait")."""


@dataclass(frozen=True)
class PlacingContext:
    """What the scheduler lends ``admit``: made once, at start-up."""

    view: RegistryView
    """The registry snapshot, kept fresh in the background (``view.workers``)."""
    registry: Registry
    """For what a snapshot is too old for (a DP group's running step end, read as it is needed)."""
    local: Local
    """This replica's reservations since the snapshot: the same mapping ``place`` is given."""


class Policy(ABC):
    """A routing policy. Implement ``place``; a batch policy also overrides ``admit``."""

    name: ClassVar[str] = ""
    """Its name in the registry and on the command line (``--mode``); set by ``register``."""

    def __init__(self, options: PolicyOptions | None = None, prefixes: Prefixes = NO_PREFIXES) -> None:
        self.options = options or PolicyOptions()
        self.rng = self.options.rng or random.Random()
        self.prefixes = prefixes
        """What the policy knows of the workers' prefix caches (``NO_PREFIXES``: nothing)."""

    def cached(self, request: GenerateRequest, candidates: Sequence[WorkerInfo] | Candidates) -> dict[str, int]:
        """The prompt tokens each candidate holds cached, when the cost weighs them ({} else)."""
        if self.options.cost.overlap_weight == 0 and not self.options.disagg.enabled:
            return {}
        if not isinstance(candidates, Candidates):
            candidates = Candidates.of(candidates)
        return self.prefixes.cached(request, candidates)

    @abstractmethod
    def place(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Decision:
        """Where one request's tasks go now.

        Called by the scheduler for each request in its waiting queue, in arrival order, on
        every loop step until the request is placed or has waited ``no_worker_wait_s``; and by
        the reaper for each task of a dead worker that it moves. ``workers`` is the current
        registry snapshot (dead and draining workers included: check ``placeable``); ``local`` holds this
        replica's reservations since it was read, and the caller adds this decision's before the
        next call. Pure: no I/O and no change to its arguments, so it is tested on hand-made
        snapshots."""

    async def admit(self, arrivals: list[Waiting], context: PlacingContext) -> Admitted:
        """What becomes of the requests one loop step just read (often none).

        Called once per step of the scheduling loop, under its placing lock, after its read and
        before it places the waiting queue; not for requests claimed from other replicas, which
        join the queue at once. The default admits every arrival into the queue. A batch policy
        holds arrivals (``Admitted.wake_at`` says when to call it again, with or without new
        ones) and places them together (``Admitted.placed``); what it cannot place joins the
        queue, where ``place`` decides it."""
        return Admitted(arrivals)
