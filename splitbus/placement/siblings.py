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

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.records import Reserved, blocks_needed
from splitbus.bus.registry import WorkerInfo
from splitbus.bus.roles import Phase
from splitbus.placement.costs import free_blocks, reserved
from splitbus.placement.decision import Decision, Placed, Placement
from splitbus.placement.ledger import Local

GROUPS_KEPT = 1024
"""Responses whose first placement is remembered (their choices arrive together: the oldest are
long placed)."""


@dataclass(frozen=True)
class _Pair:
    decode: str
    prefill: str
    twins: int
    """How many of the response's choices go there together (``Task.twins``)."""


class Siblings:
    """Where each recent response's first choice went, by (``choice_group``, ``cache_salt``).
    The scheduler (and an API node that places) decides each request through ``decide``, and
    says beforehand which requests it is about to place (``expect``): the choices among them
    that go to the first one's P together are its twins there, whose count P waits for."""

    def __init__(self, kept: int = GROUPS_KEPT) -> None:
        self.kept = kept
        self._pairs: OrderedDict[tuple[str, str], _Pair] = OrderedDict()
        self._expected: Counter[tuple[str, str]] = Counter()

    def expect(self, requests: Iterable[object]) -> None:
        """Called before a pass over the requests about to be placed (the scheduler's waiting
        queue): how many choices of each response are among them. Without it, a response's
        first choice expects all its choices (an API node places each of its own)."""
        self._expected = Counter(_key(r) for r in requests if isinstance(r, GenerateRequest) and r.choices > 1)

    def decide(
        self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local, place: Callable[[], Decision]
    ) -> Decision:
        """Where ``request`` goes: where its response's first choice went (``follow``), or where
        ``place`` (the policy) puts it; a first choice's pair is kept for the others."""
        if request.choices < 2:
            return place()
        followed = self.follow(request, workers, local)
        if followed is not None:
            return followed
        decision = place()
        return self._first(request, decision) if isinstance(decision, Placed) else decision

    def follow(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Placed | None:
        """The placement of a choice whose sibling was placed first: its P and D, if both are
        alive and D has room; None: the policy places it."""
        pair = self._pairs.get(_key(request))
        if pair is None:
            return None
        found = {w.record.worker_id: w for w in workers if w.alive}
        decode, prefill = found.get(pair.decode), found.get(pair.prefill)
        if decode is None or prefill is None:
            return None
        blocks = blocks_needed(request, decode.record.block_size)
        if free_blocks(decode, reserved(local, decode)) < blocks:
            return None
        # Its prefill shares its sibling's forward: it reserves no prefill tokens of its own.
        return Placed(
            (
                Placement(decode, Phase.DECODE, pair.prefill, Reserved(reserved_requests=1, reserved_kv_blocks=blocks)),
                Placement(prefill, Phase.PREFILL, pair.decode, Reserved(), twins=pair.twins),
            )
        )

    def _first(self, request: GenerateRequest, decision: Placed) -> Placed:
        """A response's first choice placed: a splitwise pair is kept for the others, and its
        prefill task says how many are expected there with it."""
        phases = {p.phase: p for p in decision.placements if not p.batch_id}
        decode, prefill = phases.get(Phase.DECODE), phases.get(Phase.PREFILL)
        if decode is None or prefill is None:
            return decision
        key = _key(request)
        twins = min(self._expected.get(key, request.choices), request.choices)
        self._pairs[key] = _Pair(decode.worker.record.worker_id, prefill.worker.record.worker_id, max(twins, 1))
        while len(self._pairs) > self.kept:
            self._pairs.popitem(last=False)
        return Placed(tuple(replace(p, twins=max(twins, 1)) if p is prefill else p for p in decision.placements))


def _key(request: GenerateRequest) -> tuple[str, str]:
    return request.choice_group, request.cache_salt
