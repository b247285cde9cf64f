"""Placement: pure functions over a registry snapshot, so they are tested on hand-made data.

P is chosen by queued prefill tokens, D by free KV blocks then running requests. Among
candidates within ``NEAR`` of the best, the choice is random, so scheduler replicas working
from the same snapshot do not all pick the same worker.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Reserved, WorkerInfo

NEAR = 0.1
"""Relative slack within which candidates count as equally loaded."""
C = TypeVar("C")


@dataclass(frozen=True)
class Placement:
    """One task to write: the worker, the phase, the peer, and the load to reserve."""

    worker: WorkerInfo
    phase: str
    peer: str
    reserve: Reserved
    batch_id: str = ""
    batch_ranks: int = 0


def blocks_needed(request: GenerateRequest, block_size: int) -> int:
    return math.ceil((len(request.prompt_token_ids) + request.sampling.max_tokens) / max(block_size, 1))


def free_blocks(worker: WorkerInfo, local: Reserved) -> int:
    return worker.record.load.free_kv_blocks - worker.reserved.reserved_kv_blocks - local.reserved_kv_blocks


def queued_prefill(worker: WorkerInfo, local: Reserved) -> int:
    load = worker.record.load
    return load.queued_prefill_tokens + worker.reserved.reserved_prefill_tokens + local.reserved_prefill_tokens


def active_requests(worker: WorkerInfo, local: Reserved) -> int:
    load = worker.record.load
    return load.running + load.waiting + worker.reserved.reserved_requests + local.reserved_requests


def choose(candidates: Sequence[C], cost: Callable[[C], float], rng: random.Random) -> C | None:
    """A random candidate among those within NEAR of the lowest cost."""
    if not candidates:
        return None
    costs = [cost(w) for w in candidates]
    best = min(costs)
    bound = best + abs(best) * NEAR
    return rng.choice([w for w, c in zip(candidates, costs) if c <= bound])


def eligible(workers: Sequence[WorkerInfo], model: str, role: str) -> list[WorkerInfo]:
    return [w for w in workers if w.alive and w.record.model == model and w.record.role == role]


class Policy:
    def __init__(self, mode: str, rng: random.Random | None = None) -> None:
        self.mode = mode
        self.rng = rng or random.Random()
        self._snapshot: Sequence[WorkerInfo] | None = None
        self._eligible: dict[tuple[str, str], list[WorkerInfo]] = {}

    def eligible(self, workers: Sequence[WorkerInfo], model: str, role: str) -> list[WorkerInfo]:
        """``eligible``, kept per snapshot: a snapshot serves hundreds of decisions."""
        if workers is not self._snapshot:
            self._snapshot, self._eligible = workers, {}
        key = (model, role)
        if key not in self._eligible:
            self._eligible[key] = eligible(workers, model, role)
        return self._eligible[key]

    def place(
        self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: dict[str, Reserved]
    ) -> list[Placement] | str:
        """The tasks for one request, or the reason no placement exists now."""
        if self.mode == "mixed":
            return self._mixed(request, workers, local)
        if self.mode == "dp":
            return self._dp(request, workers, local)
        return self._splitwise(request, workers, local)

    def _dp(
        self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: dict[str, Reserved]
    ) -> list[Placement] | str:
        """Naive DP: each arrival at once to the rank with the fewest queued prefill tokens."""
        ranks = [
            w
            for w in dp_ranks(workers, request.model)
            if free_blocks(w, _get(local, w)) >= blocks_needed(request, w.record.block_size)
        ]
        rank = choose(ranks, lambda w: queued_prefill(w, _get(local, w)), self.rng)
        if rank is None:
            return f"no live DP rank with room serves model '{request.model}'"
        return [dp_placement(rank, request)]

    def _splitwise(
        self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: dict[str, Reserved]
    ) -> list[Placement] | str:
        decode = self._decode_worker(request, self.eligible(workers, request.model, "decode"), local)
        prefill = choose(
            self.eligible(workers, request.model, "prefill"), lambda w: queued_prefill(w, _get(local, w)), self.rng
        )
        if prefill is None or decode is None:
            missing = "prefill" if prefill is None else "decode"
            return f"no live {missing} worker with room serves model '{request.model}'"
        tokens = len(request.prompt_token_ids)
        blocks = blocks_needed(request, decode.record.block_size)
        return [
            Placement(
                decode, "decode", prefill.record.worker_id, Reserved(reserved_requests=1, reserved_kv_blocks=blocks)
            ),
            Placement(prefill, "prefill", decode.record.worker_id, Reserved(reserved_prefill_tokens=tokens)),
        ]

    def _mixed(
        self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: dict[str, Reserved]
    ) -> list[Placement] | str:
        worker = self._decode_worker(request, self.eligible(workers, request.model, "mixed"), local)
        if worker is None:
            return f"no live mixed worker with room serves model '{request.model}'"
        blocks = blocks_needed(request, worker.record.block_size)
        reserve = Reserved(len(request.prompt_token_ids), 1, blocks)
        return [Placement(worker, "mixed", "", reserve)]

    def _decode_worker(
        self, request: GenerateRequest, candidates: list[WorkerInfo], local: dict[str, Reserved]
    ) -> WorkerInfo | None:
        free = {id(w): free_blocks(w, _get(local, w)) for w in candidates}
        needs = {size: blocks_needed(request, size) for size in {w.record.block_size for w in candidates}}
        roomy = [w for w in candidates if free[id(w)] >= needs[w.record.block_size]]
        most_free = choose(roomy, lambda w: -free[id(w)], self.rng)
        if most_free is None:
            return None
        floor = free[id(most_free)]
        tied = [w for w in roomy if free[id(w)] >= floor - abs(floor) * NEAR]
        return choose(tied, lambda w: active_requests(w, _get(local, w)), self.rng)


def _get(local: dict[str, Reserved], worker: WorkerInfo) -> Reserved:
    return local.get(worker.record.worker_id) or Reserved()


def dp_ranks(workers: Sequence[WorkerInfo], model: str) -> list[WorkerInfo]:
    """Ranks of complete DP groups only: a group missing a rank cannot step."""
    ranks = [w for w in eligible(workers, model, "mixed") if w.record.dp_size > 0]
    members: dict[str, int] = {}
    for w in ranks:
        members[w.record.dp_group] = members.get(w.record.dp_group, 0) + 1
    return [w for w in ranks if members[w.record.dp_group] == w.record.dp_size]


def dp_placement(rank: WorkerInfo, request: GenerateRequest, batch_id: str = "", batch_ranks: int = 0) -> Placement:
    blocks = blocks_needed(request, rank.record.block_size)
    return Placement(rank, "mixed", "", Reserved(len(request.prompt_token_ids), 1, blocks), batch_id, batch_ranks)
