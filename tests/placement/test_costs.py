"""The placement costs on hand-made snapshots (pure logic): a cached prefix credited against
load, the load cap that keeps a hot prefix from piling work onto its owner, water-filling with
cached tokens."""

from __future__ import annotations

import random

from splitbus.bus.records import Reserved
from splitbus.placement.costs import LOAD_ONLY, CacheCost, choose, mixed_cost, prefill_cost
from splitbus.placement.stagger import Credit, Job, RankLoad, water_fill
from tests.placement.snapshot import request, worker


def test_a_cached_prefix_is_credited_against_queued_tokens() -> None:
    p0, p1 = worker("p0", "prefill", queued=1000), worker("p1", "prefill", queued=0)
    workers = [p0, p1]
    cost = prefill_cost(workers, request(prompt=1800), {"p0": 1500}, {}, CacheCost(overlap_weight=1.0))
    assert (cost(p0), cost(p1)) == (1000 + 1800 - 1500, 1800)
    assert prefill_cost(workers, request(prompt=1800), {"p0": 1500}, {}, CacheCost())(p0) == 1000 + 1800 - 4 * 1500
    assert choose(workers, cost, random.Random(0)) is p0
    load_only = prefill_cost(workers, request(prompt=1800), {"p0": 1500}, {}, LOAD_ONLY)
    assert choose(workers, load_only, random.Random(0)) is p1


def test_the_owner_of_a_hot_prefix_gets_no_credit_past_the_load_cap() -> None:
    owner, idle = worker("p0", "prefill", queued=5000), worker("p1", "prefill", queued=0)
    generous = CacheCost(overlap_weight=4.0, load_cap_tokens=4000)
    cost = prefill_cost([owner, idle], request(prompt=1800), {"p0": 1700}, {}, generous)
    assert cost(owner) == 5000 + 1800  # over the idle one by more than the cap: no credit
    assert choose([owner, idle], cost, random.Random(0)) is idle
    # this replica's own reservations count as load too
    local = {"p1": Reserved(reserved_prefill_tokens=4500)}
    cost = prefill_cost([owner, idle], request(prompt=1800), {"p0": 1700}, local, generous)
    assert cost(owner) == 5000 + 1800 - 4 * 1700


def test_a_mixed_worker_costs_its_prefill_in_blocks_plus_the_blocks_its_requests_hold() -> None:
    busy, cold = worker("w0", "mixed", free=400), worker("w1", "mixed", free=1000)
    one = CacheCost(overlap_weight=1.0)
    cost = mixed_cost([busy, cold], request(prompt=1600), {"w0": 1600 - 16}, {}, one)
    assert cost(busy) == 16 / 16 + 600 and cost(cold) == 1600 / 16 + 0
    assert choose([busy, cold], cost, random.Random(0)) is cold  # 600 blocks in use outweigh 99 of prefill
    cost = mixed_cost([busy, cold], request(prompt=16000), {"w0": 15984}, {}, one)
    assert choose([busy, cold], cost, random.Random(0)) is busy  # a long cached prompt outweighs them


def test_water_filling_credits_the_ranks_cached_tokens() -> None:
    ranks = [RankLoad("r0", 0, 100), RankLoad("r1", 0, 100)]
    jobs = [Job(f"j{i}", 1000, 1, {"r1": 900}) for i in range(3)] + [Job("k", 1000, 1)]
    placed = water_fill(jobs, ranks, Credit())
    assert [placed[f"j{i}"] for i in range(3)] == ["r1", "r1", "r1"]  # 100 tokens each to compute there
    assert placed["k"] == "r0"
    # no credit: chosen by level alone, though a level still grows by what the rank computes
    assert water_fill(jobs, ranks) == {"j0": "r0", "j1": "r1", "j2": "r1", "k": "r1"}
