"""The choices of one response (``n`` > 1) go to the same prefill and decode workers.

Each choice is a request of its own on the bus (``GenerateRequest.choices``, ``choice_group``).
The first one placed is placed by the policy, as any request; the others follow it to the same
P and D while both are alive and D has KV blocks for them. On P they then prefill the prompt
once (``splitbus.worker.twins``: one forward, each choice drawing its first token from its
logits with its own seed), and on D the prompt's full blocks are shared (``PagedBlocks``).

Only a splitwise placement is followed (a decode task and its prefill task); a mixed one, or a
DP group's batch, is not: the others are placed by the policy, as requests of their own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.records import Reserved, blocks_needed
from splitbus.bus.registry import WorkerInfo
from splitbus.bus.roles import Phase
from splitbus.placement.costs import free_blocks, reserved
from splitbus.placement.decision import Placed, Placement
from splitbus.placement.ledger import Local

GROUPS_KEPT = 1024
"""Responses whose first placement is remembered (their choices arrive together: the oldest are
long placed)."""


class Siblings:
    """Where each recent response's first choice went: (D's id, P's id), by ``choice_group``.
    The scheduler (and an API node that places) asks ``follow`` before its policy and tells
    ``placed`` what each choice's decision was."""

    def __init__(self, kept: int = GROUPS_KEPT) -> None:
        self.kept = kept
        self._pairs: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def follow(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Placed | None:
        """The placement of a choice whose sibling was placed first: its P and D, if both are
        alive and D has room; None: the policy places it."""
        pair = self._pairs.get(request.choice_group) if request.choices > 1 else None
        if pair is None:
            return None
        found = {w.record.worker_id: w for w in workers if w.record.worker_id in pair and w.alive}
        decode, prefill = found.get(pair[0]), found.get(pair[1])
        if decode is None or prefill is None:
            return None
        blocks = blocks_needed(request, decode.record.block_size)
        if free_blocks(decode, reserved(local, decode)) < blocks:
            return None
        # Its prefill shares its sibling's forward: it reserves no prefill tokens of its own.
        return Placed(
            (
                Placement(decode, Phase.DECODE, pair[1], Reserved(reserved_requests=1, reserved_kv_blocks=blocks)),
                Placement(prefill, Phase.PREFILL, pair[0], Reserved()),
            )
        )

    def placed(self, request: GenerateRequest, decision: Placed) -> None:
        """Called once a choice is placed: the first of its response sets where the others go."""
        if request.choices < 2 or request.choice_group in self._pairs:
            return
        phases = {p.phase: p for p in decision.placements if not p.batch_id}
        decode, prefill = phases.get(Phase.DECODE), phases.get(Phase.PREFILL)
        if decode is None or prefill is None:
            return
        self._pairs[request.choice_group] = (decode.worker.record.worker_id, prefill.worker.record.worker_id)
        while len(self._pairs) > self.kept:
            self._pairs.popitem(last=False)
