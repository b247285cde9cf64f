"""What every policy places with: pure functions over a registry snapshot, so they are tested on
hand-made data.

P is chosen by its prefill cost: queued prefill tokens plus the request's prompt tokens it does
not hold cached (``prefill_cost``); D by free KV blocks then running requests; a mixed worker by
both (``mixed_cost``). Among candidates within ``NEAR`` of the best, the choice is random, so
scheduler replicas working from the same snapshot do not all pick the same worker.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.records import Reserved, blocks_needed
from splitbus.bus.registry import WorkerInfo
from splitbus.bus.roles import Phase, Role
from splitbus.placement.decision import Placement
from splitbus.placement.ledger import Local
from splitbus.placement.stagger import LOAD_CAP_TOKENS, OVERLAP_WEIGHT, Credit

NEAR = 0.1
"""Relative slack within which candidates count as equally loaded."""
C = TypeVar("C")


@dataclass(frozen=True)
class CacheCost:
    """How a policy weighs the prompt tokens a worker holds cached against its load
    (docs/routing.md, "The cost")."""

    overlap_weight: float = OVERLAP_WEIGHT
    """Tokens of credit per cached prompt token: 0 places by load alone; 1 counts a cached token
    as one this request need not wait for (greedy for its time to first token, which spreads a
    prefix's requests over idle workers, each computing the prefix again); the default, 4, also
    counts what a recomputation costs the requests queued behind it and the cache room it takes:
    measured, it keeps the hit ratio at the ideal one where 1 and 2 gave 28 % and 63 % of 72 %
    (docs/benchmarks.md)."""
    load_cap_tokens: int = LOAD_CAP_TOKENS
    """A worker whose queued prefill tokens exceed the least loaded candidate's by more than this
    gets no credit: the owner of a hot prefix cannot pile up work while others idle (it spills to
    them, and they cache the prefix too)."""

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.load_cap_tokens < 0:
            raise ValueError("overlap_weight and load_cap_tokens must be >= 0")


DEFAULT_COST = CacheCost()
LOAD_ONLY = CacheCost(overlap_weight=0.0)


def credit(cost: CacheCost) -> Credit:
    """The cost's knobs as water-filling takes them."""
    return Credit(cost.overlap_weight, cost.load_cap_tokens)


def reserved(local: Local, worker: WorkerInfo) -> Reserved:
    """What this replica reserved on ``worker`` since the snapshot."""
    return local.get(worker.record.worker_id) or Reserved()


def free_blocks(worker: WorkerInfo, local: Reserved) -> int:
    return worker.record.load.free_kv_blocks - worker.reserved.reserved_kv_blocks - local.reserved_kv_blocks


def queued_prefill(worker: WorkerInfo, local: Reserved) -> int:
    load = worker.record.load
    return load.queued_prefill_tokens + worker.reserved.reserved_prefill_tokens + local.reserved_prefill_tokens


def active_requests(worker: WorkerInfo, local: Reserved) -> int:
    load = worker.record.load
    return load.running + load.waiting + worker.reserved.reserved_requests + local.reserved_requests


def prefill_cost(
    candidates: Sequence[WorkerInfo], request: GenerateRequest, cached: dict[str, int], local: Local, cost: CacheCost
) -> Callable[[WorkerInfo], float]:
    """A candidate's prefill cost for ``request``: its queued prefill tokens, plus the prompt's
    tokens, less ``overlap_weight`` per prompt token it holds cached (``cached``, by worker id),
    unless its queue is over the least loaded candidate's by more than ``load_cap_tokens``."""
    queued = {id(w): queued_prefill(w, reserved(local, w)) for w in candidates}
    floor = min(queued.values(), default=0)
    prompt = len(request.prompt_token_ids)

    def of(w: WorkerInfo) -> float:
        mine = queued[id(w)] if id(w) in queued else queued_prefill(w, reserved(local, w))
        credit = cached.get(w.record.worker_id, 0) if mine - floor <= cost.load_cap_tokens else 0
        return mine + prompt - cost.overlap_weight * credit

    return of


def used_blocks(worker: WorkerInfo, local: Reserved) -> int:
    """KV blocks held by requests, reserved ones included (cached free blocks count as free)."""
    return worker.record.load.total_kv_blocks - free_blocks(worker, local)


def mixed_cost(
    candidates: Sequence[WorkerInfo], request: GenerateRequest, cached: dict[str, int], local: Local, cost: CacheCost
) -> Callable[[WorkerInfo], float]:
    """A worker that prefills and decodes: its prefill cost in blocks plus the KV blocks its
    requests hold (the decode load), as Dynamo's KV router weighs them."""
    prefill = prefill_cost(candidates, request, cached, local, cost)
    return lambda w: prefill(w) / w.record.block_size + used_blocks(w, reserved(local, w))


def choose(candidates: Sequence[C], cost: Callable[[C], float], rng: random.Random) -> C | None:
    """A random candidate among those within NEAR of the lowest cost."""
    if not candidates:
        return None
    costs = [cost(w) for w in candidates]
    best = min(costs)
    bound = best + abs(best) * NEAR
    return rng.choice([w for w, c in zip(candidates, costs, strict=True) if c <= bound])


def eligible(workers: Sequence[WorkerInfo], model: str, role: str) -> list[WorkerInfo]:
    return [w for w in workers if w.placeable and w.record.model == model and w.record.role == role]


class Eligible:
    """``eligible``, kept per snapshot: a snapshot serves hundreds of decisions."""

    def __init__(self) -> None:
        self._snapshot: Sequence[WorkerInfo] | None = None
        self._eligible: dict[tuple[str, str], list[WorkerInfo]] = {}

    def __call__(self, workers: Sequence[WorkerInfo], model: str, role: str) -> list[WorkerInfo]:
        if workers is not self._snapshot:
            self._snapshot, self._eligible = workers, {}
        key = (model, role)
        if key not in self._eligible:
            self._eligible[key] = eligible(workers, model, role)
        return self._eligible[key]


def roomy(request: GenerateRequest, candidates: Sequence[WorkerInfo], local: Local) -> list[WorkerInfo]:
    """The candidates with free KV blocks for the request's prompt and output."""
    needs = {size: blocks_needed(request, size) for size in {w.record.block_size for w in candidates}}
    return [w for w in candidates if free_blocks(w, reserved(local, w)) >= needs[w.record.block_size]]


def decode_worker(
    request: GenerateRequest, candidates: list[WorkerInfo], local: Local, rng: random.Random
) -> WorkerInfo | None:
    """The worker to decode on: the most free KV blocks (within NEAR), then the fewest active
    requests; None when none has blocks for the request."""
    room = roomy(request, candidates, local)
    free = {id(w): free_blocks(w, reserved(local, w)) for w in room}
    most_free = choose(room, lambda w: -free[id(w)], rng)
    if most_free is None:
        return None
    floor = free[id(most_free)]
    tied = [w for w in room if free[id(w)] >= floor - abs(floor) * NEAR]
    return choose(tied, lambda w: active_requests(w, reserved(local, w)), rng)


def complete_groups(workers: Sequence[WorkerInfo], model: str, role: str) -> dict[str, list[WorkerInfo]]:
    """The live DP ranks of ``role`` serving ``model``, by group, for complete groups only (every
    rank 0..dp_size-1 live, all agreeing on dp_size and on one formed epoch): a group missing a rank
    cannot step. Ranks keep their snapshot order."""
    groups: dict[str, list[WorkerInfo]] = {}
    for w in eligible(workers, model, role):
        if w.record.dp_size > 0:
            groups.setdefault(w.record.dp_group, []).append(w)
    return {g: ranks for g, ranks in groups.items() if _complete(ranks)}


def _complete(ranks: list[WorkerInfo]) -> bool:
    """Every rank 0..size-1 live, all agreeing on the size and on a formed epoch (``dp_epoch``): a
    rank restarted after a kill, beside survivors that have not yet found the group broken, has all
    the ranks live but steps with nobody."""
    # The sizes come from the registry: compared with the ranks seen before anything is built from them.
    size, epoch = len(ranks), ranks[0].record.load.dp_epoch
    if epoch == 0 or any(r.record.load.dp_epoch != epoch for r in ranks):
        return False
    return all(r.record.dp_size == size for r in ranks) and {r.record.dp_rank for r in ranks} == set(range(size))


def dp_ranks(workers: Sequence[WorkerInfo], model: str) -> list[WorkerInfo]:
    """Ranks of complete ``mixed`` DP groups only, in snapshot order."""
    groups = complete_groups(workers, model, Role.MIXED)
    return [w for w in eligible(workers, model, Role.MIXED) if w.record.dp_size > 0 and w.record.dp_group in groups]


def dp_placement(
    rank: WorkerInfo, request: GenerateRequest, batch_id: str = "", batch_ranks: int = 0, cached: int = 0
) -> Placement:
    """A request's mixed task on a DP rank, which reserves the prompt tokens it computes (all but
    the ``cached`` ones) and the request's blocks."""
    blocks = blocks_needed(request, rank.record.block_size)
    tokens = len(request.prompt_token_ids) - cached
    return Placement(rank, Phase.MIXED, "", Reserved(tokens, 1, blocks), batch_id, batch_ranks)
