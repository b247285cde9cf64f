"""The choices of one response (``n`` > 1) go to the same prefill and decode workers.

Each choice is a request of its own on the bus (``GenerateRequest.choices``, ``choice_group``).
The first one placed is placed by the policy, as any request; the others follow it to the same
P and D while both are alive and D has KV blocks for them. On P they then prefill the prompt
once (``splitbus.worker.twins``: one forward, each choice drawing its first token from its
logits with its own seed), and on D the prompt's full blocks are shared (``PagedBlocks``).

Once a pass's decisions are made (the scheduler's over its waiting queue, an API node's over
its choices), ``twins`` tells each choice's prefill task how many of its response's choices the
pass sends to that worker (``Task.twins``), which P waits for, briefly, to prefill them once.

Only a splitwise placement is followed (a decode task and its prefill task); a mixed one, or a
DP group's batch, is not, nor a request that a batching policy places as it admits it
(``Policy.admit``: ``stagger``, ``splitwise_dp``): those choices are placed by the policy, as
requests of their own, and prefill each on its own.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
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


class Siblings:
    """Where each recent response's first choice went, by (``choice_group``, ``cache_salt``).
    The scheduler (and an API node that places) decides each request through ``decide``, then,
    once a pass's decisions are made and before any is written, has ``twins`` tell each prefill
    task how many choices of its response that pass sends to its worker."""

    def __init__(self, kept: int = GROUPS_KEPT) -> None:
        self.kept = kept
        self._pairs: OrderedDict[tuple[str, str], _Pair] = OrderedDict()

    def decide(
        self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local, place: Callable[[], Decision]
    ) -> Decision:
        """Where ``request`` goes: where its response's first choice went (``follow``), or where
        ``place`` (the policy) puts it; the first choice's pair is kept for the others."""
        if request.choices < 2:
            return place()
        followed = self.follow(request, workers, local)
        if followed is not None:
            return followed
        decision = place()
        if isinstance(decision, Placed) and _key(request) not in self._pairs:
            self._keep(request, decision)
        return decision

    def follow(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Placed | None:
        """The placement of a choice whose sibling was placed first: its P and D, if both are
        alive and D has room; None: the policy places it."""
        pair = self._pairs.get(_key(request))
        if pair is None:
            return None
        found = {w.record.worker_id: w for w in workers if w.placeable}
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
                Placement(prefill, Phase.PREFILL, pair.decode, Reserved()),
            )
        )

    def _keep(self, request: GenerateRequest, decision: Placed) -> None:
        """A response's first choice placed: a splitwise pair is kept for the others."""
        phases = {p.phase: p for p in decision.placements if not p.batch_id}
        decode, prefill = phases.get(Phase.DECODE), phases.get(Phase.PREFILL)
        if decode is None or prefill is None:
            return
        self._pairs[_key(request)] = _Pair(decode.worker.record.worker_id, prefill.worker.record.worker_id)
        while len(self._pairs) > self.kept:
            self._pairs.popitem(last=False)


def twins(decided: Sequence[tuple[GenerateRequest, Placed]]) -> list[Placed]:
    """One pass's decisions, each prefill task of a choice saying how many choices of its
    response the pass sends to that worker (``Task.twins``: P waits for that many, briefly, to
    prefill them once). Counted from the decisions themselves: a choice that could not follow
    its sibling and went elsewhere is counted where it went."""
    sent = Counter(key for key in map(_twin_of, decided) if key is not None)
    stamped = []
    for request, decision in decided:
        key = _twin_of((request, decision))
        count = sent[key] if key is not None else 1
        stamped.append(
            Placed(tuple(replace(p, twins=count) if _is_twin(request, p) else p for p in decision.placements))
            if count > 1
            else decision
        )
    return stamped


def _twin_of(item: tuple[GenerateRequest, Placed]) -> tuple[str, str, str] | None:
    request, decision = item
    prefill = next((p for p in decision.placements if _is_twin(request, p)), None)
    return None if prefill is None else (*_key(request), prefill.worker.record.worker_id)


def _is_twin(request: GenerateRequest, placement: Placement) -> bool:
    return request.choices > 1 and placement.phase == Phase.PREFILL and not placement.batch_id


def _key(request: GenerateRequest) -> tuple[str, str]:
    return request.choice_group, request.cache_salt
