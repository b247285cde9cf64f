"""Dispatch from the API node (``splitbus api --dispatch api``): the API places a request itself,
with the placement library a scheduler replica uses (``splitbus.placement``: its policies and
its dispatcher), and writes its tasks directly: one hop fewer than the request stream and a
scheduler replica (docs/architecture.md, "Dispatch from the API node").

It places by load alone: the workers' prefix caches are known only to scheduler replicas (their
KV index), and so are the things that need one place (DP stagger windows, the reaper, requests
no worker can take yet). A request the API cannot place at once (no worker with room, a worker
gone as the script ran, the cell recovering after a new Redis run) goes to the request stream,
as every request does with ``--dispatch scheduler``: nothing is lost either way.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from splitbus.api import metrics
from splitbus.bus.core.config import BusConfig
from splitbus.bus.dispatch import DispatchOutcome
from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry_view import RegistryView
from splitbus.placement import policies
from splitbus.placement.costs import LOAD_ONLY
from splitbus.placement.decision import Placed
from splitbus.placement.dispatcher import Dispatcher
from splitbus.placement.ledger import Ledger, Local
from splitbus.placement.policies.base import PolicyOptions
from splitbus.placement.siblings import Siblings, twins

log = logging.getLogger(__name__)

MODES = ("splitwise", "mixed")
"""The policies an API node places with: those that place each request on its own, at once."""
DISPATCHED_MARK_TTL_S = 60
"""The dispatched mark's life (a scheduler's default ``--dispatched-mark-ttl``)."""


class ApiPlacer:
    """Places a request from the API node's registry view and writes its tasks; says whether it
    did (False: the caller submits it to the schedulers)."""

    def __init__(self, redis: aioredis.Redis, bus: BusConfig, view: RegistryView, mode: str, node: str) -> None:
        if mode not in MODES:
            raise ValueError(f"--dispatch api places with {' or '.join(MODES)}, not {mode!r}")
        self.view = view
        self.policy = policies.create(mode, PolicyOptions(replica=node, cost=LOAD_ONLY))
        self.dispatcher = Dispatcher(redis, bus, DISPATCHED_MARK_TTL_S)
        self.local = Local()
        self.ledger = Ledger(self.local)
        self.siblings = Siblings()
        """Where each response's first choice went: its other choices follow (``n`` > 1)."""

    async def place(self, request: GenerateRequest) -> bool:
        """Called once per request, before any entry of it is written."""
        return (await self.place_together([request]))[0]

    async def place_together(self, requests: list[GenerateRequest]) -> list[bool]:
        """Place and write several requests (a response's choices: each choice's prefill task
        says how many go to its worker together, ``siblings.twins``); whether each was."""
        if self.view.refreshed.is_set():
            self.view.refreshed.clear()
            self.ledger.view_refreshed(self.view.read_at)
        decided = [(r, d) for r in requests if (d := self._decide(r)) is not None]
        try:
            stamped = zip(decided, twins(decided), strict=True)
            written = await asyncio.gather(*(self._write(r, d) for (r, _), d in stamped))
        finally:
            self.ledger.written()
        placed = {r.request_id for (r, _), ok in zip(decided, written, strict=True) if ok}
        return [r.request_id in placed for r in requests]

    def _decide(self, request: GenerateRequest) -> Placed | None:
        workers = self.view.workers
        decision = self.siblings.decide(
            request, workers, self.local, lambda: self.policy.place(request, workers, self.local)
        )
        if not isinstance(decision, Placed):
            metrics.DISPATCHES.labels("no_worker").inc()
            return None
        for placement in decision.placements:
            self.ledger.reserve(placement)
        return decision

    async def _write(self, request: GenerateRequest, decision: Placed) -> bool:
        outcome = await self.dispatcher.dispatch_direct(request, decision.placements)
        metrics.DISPATCHES.labels(outcome.label).inc()
        if outcome is DispatchOutcome.DUPLICATE:  # its request id was dispatched already: a bug, or a replay of one
            log.warning("request %s was dispatched already; not again", request.request_id)
        return outcome in (DispatchOutcome.DISPATCHED, DispatchOutcome.DUPLICATE)
