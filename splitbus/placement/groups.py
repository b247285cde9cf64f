"""Placement at rank level when prefill and decode workers are DP groups: pure functions over a
registry snapshot, so they are tested on hand-made data (the ``splitwise_dp`` policy uses them).

Work of a role goes to a *unit*: a single worker (``dp_size`` 0) or a complete DP group of that
role (an incomplete one cannot step and takes nothing). A request still goes to one rank: a
prefill rank and a decode rank, each of its own group.

- **Decode.** A group's step lasts as long as its busiest rank, so within a group the request goes
  to the rank that keeps the group's step shortest: the cost of adding it to rank ``i`` is
  ``(the group's most running sequences, the group's most KV blocks in use)`` with the request
  counted on ``i`` (``step_cost``), compared in that order; ties go to the rank with the least
  load of its own, then at random. Free blocks alone would not do: a rank with many free blocks may
  run the most sequences. Each group is then represented by that rank, and single workers and
  these ranks are compared as splitwise compares decode workers (most free KV blocks, then fewest
  active requests).
- **Prefill.** Placed at once, a request goes to the rank (of a single worker or of a complete
  group) with the fewest queued prefill tokens, as splitwise places P. Staggered, it goes to the
  unit with the lowest level (queued prefill tokens per rank, the requests held for the group
  included: ``prefill_unit``), and a group's held requests are water-filled over its ranks
  (``fill_group``) when its window closes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.records import Reserved
from splitbus.bus.registry import WorkerInfo
from splitbus.bus.roles import Phase
from splitbus.placement.costs import (
    DEFAULT_COST,
    CacheCost,
    active_requests,
    blocks_needed,
    choose,
    complete_groups,
    credit,
    decode_worker,
    eligible,
    free_blocks,
    queued_prefill,
    reserved,
)
from splitbus.placement.decision import Placement
from splitbus.placement.ledger import Local
from splitbus.placement.stagger import Job, RankLoad, water_fill

_NO_RANK = -(2**62)
"""Below every load: the largest load of the other ranks of a group of one."""


@dataclass(frozen=True)
class Units:
    """Where one role's work for one model can go."""

    singles: list[WorkerInfo]
    """Live single workers of the role (``dp_size`` 0), in snapshot order."""
    groups: dict[str, list[WorkerInfo]]
    """Complete DP groups of the role, by group name: their ranks, in snapshot order."""

    @property
    def ranks(self) -> list[WorkerInfo]:
        """Every worker a task can go to: the single workers, then the groups' ranks."""
        return self.singles + [r for ranks in self.groups.values() for r in ranks]


def units(workers: Sequence[WorkerInfo], model: str, role: str) -> Units:
    singles = [w for w in eligible(workers, model, role) if w.record.dp_size == 0]
    return Units(singles, complete_groups(workers, model, role))


class UnitsCache:
    """``units``, kept per snapshot: a snapshot serves hundreds of decisions."""

    def __init__(self) -> None:
        self._snapshot: Sequence[WorkerInfo] | None = None
        self._units: dict[tuple[str, str], Units] = {}

    def __call__(self, workers: Sequence[WorkerInfo], model: str, role: str) -> Units:
        if workers is not self._snapshot:
            self._snapshot, self._units = workers, {}
        if (model, role) not in self._units:
            self._units[model, role] = units(workers, model, role)
        return self._units[model, role]


@dataclass(frozen=True)
class DecodeLoad:
    """What makes a decode rank's share of a group step long."""

    sequences: int
    """Running and waiting requests, and those reserved on it."""
    kv_blocks: int
    """KV blocks in use, reservations included."""


def decode_load(rank: WorkerInfo, local: Local) -> DecodeLoad:
    mine = reserved(local, rank)
    return DecodeLoad(active_requests(rank, mine), rank.record.load.total_kv_blocks - free_blocks(rank, mine))


def step_cost(loads: Sequence[DecodeLoad], blocks: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """For each rank ``i``, the cost of adding a request (``blocks[i]`` KV blocks on it) to it:
    the group's most sequences and most KV blocks in use with the request on ``i``, then ``i``'s
    own sequences and blocks (so equal group costs go to the least loaded rank). Linear in the
    group's size: a group may have 64 ranks and a step hundreds of requests."""
    seqs = _max_after([ld.sequences for ld in loads], [1] * len(loads))
    kv = _max_after([ld.kv_blocks for ld in loads], blocks)
    return [(seqs[i], kv[i], ld.sequences, ld.kv_blocks) for i, ld in enumerate(loads)]


def _max_after(values: list[int], added: Sequence[int]) -> list[int]:
    """For each ``i``: the largest of ``values`` once ``values[i]`` grew by ``added[i]``."""
    top = max(values)
    second = max((v for v in values if v != top), default=_NO_RANK)
    shared = values.count(top) > 1
    return [max(top if v != top or shared else second, v + add) for v, add in zip(values, added, strict=True)]


def balanced_rank(
    request: GenerateRequest, ranks: Sequence[WorkerInfo], local: Local, rng: random.Random
) -> WorkerInfo | None:
    """The rank of a decode group the request keeps the group's step shortest on (``step_cost``),
    among those with KV blocks for it; None when none has them."""
    needs = [blocks_needed(request, r.record.block_size) for r in ranks]
    roomy = [i for i, r in enumerate(ranks) if free_blocks(r, reserved(local, r)) >= needs[i]]
    if not roomy:
        return None
    costs = step_cost([decode_load(r, local) for r in ranks], needs)
    lowest = min(costs[i] for i in roomy)
    return ranks[rng.choice([i for i in roomy if costs[i] == lowest])]


def decode_rank(request: GenerateRequest, decode: Units, local: Local, rng: random.Random) -> WorkerInfo | None:
    """Where the request decodes: each group's balanced rank competes with the single workers,
    by free KV blocks then active requests (``decode_worker``); None when nothing has room. With
    no groups this is splitwise's choice, random draws included."""
    best = [balanced_rank(request, ranks, local, rng) for ranks in decode.groups.values()]
    return decode_worker(request, decode.singles + [r for r in best if r is not None], local, rng)


def prefill_unit(
    prefill: Units, held_tokens: dict[str, int], local: Local, rng: random.Random
) -> WorkerInfo | str | None:
    """Where a staggered arrival waits to prefill: a single worker (placed at once) or a group's
    name (held in its window), whichever has the lowest level: queued prefill tokens per rank,
    counting the tokens already held for the group (``held_tokens``, by group). Random among
    levels within ``NEAR``; None when the role has no unit."""
    levels: list[tuple[WorkerInfo | str, float]] = [(w, queued_prefill(w, reserved(local, w))) for w in prefill.singles]
    for group, ranks in prefill.groups.items():
        queued = sum(queued_prefill(r, reserved(local, r)) for r in ranks) + held_tokens.get(group, 0)
        levels.append((group, queued / len(ranks)))
    best = choose(levels, lambda unit: unit[1], rng)
    return None if best is None else best[0]


def fill_group(
    requests: dict[str, GenerateRequest],
    ranks: Sequence[WorkerInfo],
    local: Local,
    cached: Callable[[GenerateRequest], dict[str, int]] = lambda _: {},
    cost: CacheCost = DEFAULT_COST,
) -> dict[str, WorkerInfo]:
    """A prefill group's batch water-filled over its ranks on queued prefill tokens (``water_fill``),
    each request's tokens cached on a rank (``cached``) credited by ``cost``: request key -> rank.
    A prefill rank's KV room is not checked, as splitwise does not check a prefill worker's: it
    queues what it cannot hold yet."""
    by_id = {r.record.worker_id: r for r in ranks}
    loads = [
        RankLoad(rid, queued_prefill(r, reserved(local, r)), free_blocks(r, reserved(local, r)))
        for rid, r in by_id.items()
    ]
    jobs = [
        Job(key, len(request.prompt_token_ids), 0, cached(request), request.priority)
        for key, request in requests.items()
    ]
    return {key: by_id[rank_id] for key, rank_id in water_fill(jobs, loads, credit(cost)).items()}


def pd_placements(
    request: GenerateRequest, prefill: WorkerInfo, decode: WorkerInfo, batch_id: str = "", batch_ranks: int = 0
) -> tuple[Placement, Placement]:
    """A splitwise request's two tasks, decode first: D reserves the request's blocks, P its prompt
    tokens; a staggered batch's id and rank count go with the prefill task."""
    blocks = blocks_needed(request, decode.record.block_size)
    tokens = len(request.prompt_token_ids)
    return (
        Placement(
            decode, Phase.DECODE, prefill.record.worker_id, Reserved(reserved_requests=1, reserved_kv_blocks=blocks)
        ),
        Placement(
            prefill,
            Phase.PREFILL,
            decode.record.worker_id,
            Reserved(reserved_prefill_tokens=tokens),
            batch_id,
            batch_ranks,
        ),
    )
