"""Conditional disaggregation as a pure function, and in the splitwise policy: where a request
prefills (its decode worker or a prefill worker) and why, counted by reason."""

from __future__ import annotations

import random

import pytest
from prometheus_client import REGISTRY

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.records import Reserved
from splitbus.bus.registry import WorkerInfo
from splitbus.placement.decision import Placed
from splitbus.placement.disagg import Disaggregation, Split, split
from splitbus.placement.policies import create
from splitbus.placement.policies.base import PolicyOptions
from splitbus.placement.prefixes import Candidates
from tests.placement.snapshot import request, worker

ON = Disaggregation(local_prefill_max_tokens=256, prefill_queue_bound=8000)


class Cached:
    """A hand-made prefix view: the cached prompt tokens of each worker."""

    def __init__(self, tokens: dict[str, int]) -> None:
        self.tokens = tokens

    def cached(self, request: GenerateRequest, candidates: Candidates) -> dict[str, int]:
        return {wid: tokens for wid, tokens in self.tokens.items() if wid in candidates.block_size}

    def routed(self, request: GenerateRequest, worker: WorkerInfo) -> None:
        pass


@pytest.mark.parametrize(
    ("config", "prompt", "cached", "queues", "free", "expected"),
    [
        (Disaggregation(), 10, 0, [0], 1000, Split(False, "off")),
        (ON, 200, 0, [0], 1000, Split(True, "short_prompt")),
        (ON, 3000, 2900, [0], 1000, Split(True, "short_prompt")),  # what D would compute is short
        (ON, 3000, 0, [0], 1000, Split(False, "long_prompt")),
        (ON, 3000, 0, [9000, 8001], 1000, Split(True, "prefill_busy")),
        (ON, 3000, 0, [9000, 100], 1000, Split(False, "long_prompt")),
        (ON, 3000, 0, [], 1000, Split(True, "no_prefill_worker")),
        (ON, 200, 0, [0], 110, Split(False, "decode_kv_full")),  # 110 - 15 blocks left < 10 % of 1000
        (Disaggregation(256, min_free_kv=0.0), 200, 0, [0], 15, Split(True, "short_prompt")),
    ],
)
def test_where_a_request_prefills(
    config: Disaggregation, prompt: int, cached: int, queues: list[int], free: int, expected: Split
) -> None:
    decode = worker("d", "decode", free=free)
    assert split(config, request(prompt, max_tokens=28), decode, cached, queues, {}) == expected


def test_this_replicas_reservations_count_against_the_decode_workers_room() -> None:
    decode = worker("d", "decode", free=200)
    local = {"d": Reserved(reserved_kv_blocks=90)}
    assert split(ON, request(200), decode, 0, [0], local) == Split(False, "decode_kv_full")


def _decisions(decision: str, reason: str) -> float:
    labels = {"decision": decision, "reason": reason}
    return REGISTRY.get_sample_value("splitbus_scheduler_disagg_decisions_total", labels) or 0.0


def test_splitwise_prefills_a_short_uncached_suffix_on_the_decode_worker_that_holds_the_history() -> None:
    workers = [
        worker("p", "prefill"),
        worker("d-cold", "decode", free=900),
        worker("d-warm", "decode", free=850),
    ]
    policy = create("splitwise", PolicyOptions(rng=random.Random(0), disagg=ON), Cached({"d-warm": 2800}))
    before = _decisions("local", "short_prompt")
    plan = policy.place(request(prompt=3000), workers, {})
    assert isinstance(plan, Placed)
    (task,) = plan.placements
    assert (task.worker.record.worker_id, task.phase, task.peer) == ("d-warm", "mixed", "")
    assert task.reserve == Reserved(3000 - 2800, 1, -(-3028 // 16))  # it computes only the uncached 200
    assert _decisions("local", "short_prompt") == before + 1
    long = policy.place(request(prompt=3000), [w for w in workers if w.record.worker_id != "d-warm"], {})
    assert isinstance(long, Placed)
    assert [(p.worker.record.worker_id, p.phase) for p in long.placements] == [("d-cold", "decode"), ("p", "prefill")]


def test_splitwise_without_conditional_disaggregation_never_prefills_on_the_decode_worker() -> None:
    workers = [worker("p", "prefill", queued=50_000), worker("d", "decode")]
    policy = create("splitwise", PolicyOptions(rng=random.Random(0)), Cached({"d": 99}))
    plan = policy.place(request(prompt=100), workers, {})
    assert isinstance(plan, Placed) and [p.phase for p in plan.placements] == ["decode", "prefill"]
