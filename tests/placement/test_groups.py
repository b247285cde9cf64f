"""Placement at rank level (splitbus/placement/groups.py) on hand-made snapshots of prefill and
decode DP groups, mixed with single workers (pure logic)."""

from __future__ import annotations

import random

from splitbus.bus.records import Reserved
from splitbus.bus.registry import WorkerInfo
from splitbus.placement.costs import complete_groups, decode_worker, dp_ranks
from splitbus.placement.groups import (
    DecodeLoad,
    balanced_rank,
    decode_load,
    decode_rank,
    fill_group,
    pd_placements,
    prefill_unit,
    step_cost,
    units,
)
from tests.placement.policies.dp_ranks import rank
from tests.placement.snapshot import request, worker


def _ids(ranks: list[WorkerInfo]) -> list[str]:
    return [r.record.worker_id for r in ranks]


def test_only_complete_groups_of_the_role_count() -> None:
    workers = [
        *[rank("p0", i, 2, role="prefill") for i in range(2)],  # complete
        rank("p1", 0, 2, role="prefill"),  # rank 1 missing
        rank("p2", 0, 2, role="prefill"),
        rank("p2", 1, 2, role="prefill", alive=False),  # rank 1 dead
        rank("p3", 0, 2, role="prefill"),
        rank("p3", 0, 2, role="prefill"),  # two rank 0s, no rank 1
        *[rank("m0", i, 2) for i in range(2)],  # mixed: another role
        worker("p-single", "prefill"),
    ]
    assert {g: _ids(r) for g, r in complete_groups(workers, "m", "prefill").items()} == {"p0": ["p0-r0", "p0-r1"]}
    assert complete_groups(workers, "other-model", "prefill") == {}
    assert _ids(dp_ranks(workers, "m")) == ["m0-r0", "m0-r1"]  # mixed groups, as before
    prefill = units(workers, "m", "prefill")
    assert _ids(prefill.singles) == ["p-single"] and _ids(prefill.ranks) == ["p-single", "p0-r0", "p0-r1"]


def test_a_group_whose_ranks_disagree_on_its_size_is_not_complete() -> None:
    workers = [rank("d0", 0, 2, role="decode"), rank("d0", 1, 3, role="decode")]
    assert complete_groups(workers, "m", "decode") == {}
    claims_a_huge_group = [
        rank("d1", 0, 10**15, role="decode")
    ]  # a record's size is untrusted: nothing is built from it
    assert complete_groups(claims_a_huge_group, "m", "decode") == {}


def test_a_group_is_complete_only_once_all_its_ranks_formed_one_epoch() -> None:
    """A rank killed and restarted shows epoch 0 beside survivors still in the old epoch (they
    have not yet found the group broken): all ranks are live, but nobody steps with the new one."""
    formed = [rank("d0", i, 3, role="decode", epoch=7) for i in range(3)]
    assert list(complete_groups(formed, "m", "decode")) == ["d0"]
    restarted = [*formed[:2], rank("d0", 2, 3, role="decode", epoch=0)]
    assert complete_groups(restarted, "m", "decode") == {}
    half_re_formed = [*formed[:2], rank("d0", 2, 3, role="decode", epoch=9)]
    assert complete_groups(half_re_formed, "m", "decode") == {}
    assert complete_groups([rank("d0", i, 3, role="decode", epoch=0) for i in range(3)], "m", "decode") == {}


def test_step_cost_is_the_groups_busiest_rank_with_the_request_added() -> None:
    loads = [DecodeLoad(3, 900), DecodeLoad(4, 100), DecodeLoad(5, 200)]
    costs = step_cost(loads, [8, 8, 8])
    assert costs == [(5, 908, 3, 900), (5, 900, 4, 100), (6, 900, 5, 200)]
    assert step_cost([DecodeLoad(2, 10)], [8]) == [(3, 18, 2, 10)]  # a group of one


def test_step_cost_matches_recomputing_the_maxima_rank_by_rank() -> None:
    rng = random.Random(5)
    for size in (1, 2, 3, 8):
        loads = [DecodeLoad(rng.randint(0, 3), rng.choice([0, 50, 100])) for _ in range(size)]
        blocks = [rng.randint(1, 60) for _ in range(size)]
        expected = []
        for i, own in enumerate(loads):
            after = [
                DecodeLoad(ld.sequences + 1, ld.kv_blocks + blocks[i]) if j == i else ld for j, ld in enumerate(loads)
            ]
            expected.append(
                (max(a.sequences for a in after), max(a.kv_blocks for a in after), own.sequences, own.kv_blocks)
            )
        assert step_cost(loads, blocks) == expected


def test_the_decode_rank_keeps_the_groups_step_shortest_not_the_one_with_most_free_blocks() -> None:
    # r0 has the most free blocks but runs the most sequences: placing there lengthens the group's step.
    group = [
        rank("d0", 0, 3, role="decode", free=900, running=6),
        rank("d0", 1, 3, role="decode", free=300, running=2),
        rank("d0", 2, 3, role="decode", free=500, running=2),
    ]
    chosen = balanced_rank(request(), group, {}, random.Random(0))
    assert chosen is not None and chosen.record.worker_id == "d0-r2"  # equal sequences: the one using less KV
    best_by_free = decode_worker(request(), group, {}, random.Random(0))
    assert best_by_free is not None and best_by_free.record.worker_id == "d0-r0"


def _group_max(group: list[WorkerInfo], target: WorkerInfo) -> tuple[int, int]:
    """The group's most sequences and most KV blocks in use with request() added on ``target``."""
    after = [decode_load(r, {r.record.worker_id: Reserved(0, 1, 8)} if r is target else {}) for r in group]
    return max(a.sequences for a in after), max(a.kv_blocks for a in after)


def test_the_chosen_decode_rank_leaves_the_lowest_group_maximum() -> None:
    rng = random.Random(3)
    for _ in range(50):
        group = [
            rank("d0", i, 4, role="decode", free=rng.choice([0, 8, 200, 900]), running=rng.randint(0, 4))
            for i in range(4)
        ]
        chosen = balanced_rank(request(), group, {}, rng)
        roomy = [r for r in group if r.record.load.free_kv_blocks >= 8]
        if not roomy:
            assert chosen is None
            continue
        assert chosen in roomy

        assert _group_max(group, chosen) == min(_group_max(group, r) for r in roomy)


def test_reservations_count_in_the_decode_balance() -> None:
    group = [rank("d0", i, 2, role="decode") for i in range(2)]
    local = {"d0-r0": Reserved(reserved_requests=3, reserved_kv_blocks=24)}
    chosen = balanced_rank(request(), group, local, random.Random(0))
    assert chosen is not None and chosen.record.worker_id == "d0-r1"


def test_single_decode_workers_compete_with_each_groups_balanced_rank() -> None:
    workers = [
        worker("d-single", "decode", free=400),
        rank("d0", 0, 2, role="decode", free=950, running=9),
        rank("d0", 1, 2, role="decode", free=700, running=1),
        rank("d1", 0, 2, role="decode", free=990),  # d1 lacks rank 1: takes nothing
    ]
    chosen = decode_rank(request(), units(workers, "m", "decode"), {}, random.Random(0))
    assert chosen is not None and chosen.record.worker_id == "d0-r1"  # more free than d-single
    full = [rank("d0", 0, 1, role="decode", free=3), worker("d-single", "decode", free=3)]
    assert decode_rank(request(), units(full, "m", "decode"), {}, random.Random(0)) is None


def test_with_single_workers_only_the_decode_choice_is_splitwises_draw_for_draw() -> None:
    singles = [worker(f"d{i}", "decode", free=900 - i, running=i % 3) for i in range(6)]
    for seed in range(20):
        mine = decode_rank(request(), units(singles, "m", "decode"), {}, random.Random(seed))
        assert mine is decode_worker(request(), singles, {}, random.Random(seed))


def test_a_staggered_arrival_goes_to_the_unit_with_the_lowest_level_per_rank() -> None:
    workers = [
        worker("p-single", "prefill", queued=300),
        *[rank("p0", i, 4, role="prefill", queued=400) for i in range(4)],
    ]
    prefill = units(workers, "m", "prefill")
    assert prefill_unit(prefill, {}, {}, random.Random(0)) == prefill.singles[0]  # 300 < 400 per rank
    both_idle = units(
        [worker("p-single", "prefill"), *[rank("p0", i, 4, role="prefill") for i in range(4)]], "m", "prefill"
    )
    assert prefill_unit(both_idle, {"p0": 2000}, {}, random.Random(0)) == both_idle.singles[0]  # what it holds counts
    assert prefill_unit(units([rank("p0", 0, 1, role="prefill")], "m", "prefill"), {}, {}, random.Random(0)) == "p0"
    assert prefill_unit(units([], "m", "prefill"), {}, {}, random.Random(0)) is None


def test_a_prefill_groups_batch_is_water_filled_over_its_ranks() -> None:
    ranks = [rank("p0", 0, 3, role="prefill", queued=500), *[rank("p0", i, 3, role="prefill") for i in (1, 2)]]
    batch = {"a": request(prompt=400), "b": request(prompt=300), "c": request(prompt=200), "d": request(prompt=100)}
    filled = {key: r.record.worker_id for key, r in fill_group(batch, ranks, {}).items()}
    # largest first, each to the lowest level: a->r1, b->r2, c->r2 (300), d->r1 (400): every rank ends at 500
    assert filled == {"a": "p0-r1", "b": "p0-r2", "c": "p0-r2", "d": "p0-r1"}
    alone = rank("p1", 0, 1, role="prefill", free=0)  # a prefill rank's KV room is not checked
    assert fill_group(batch, [alone], {}) == dict.fromkeys(batch, alone)


def test_a_requests_two_tasks_name_each_other_and_the_batch_goes_with_the_prefill() -> None:
    p, d = rank("p0", 1, 2, role="prefill"), rank("d0", 0, 2, role="decode")
    decode, prefill = pd_placements(request(), p, d, "s1.4", 2)
    assert (decode.worker, decode.phase, decode.peer, decode.batch_id) == (d, "decode", "p0-r1", "")
    assert (prefill.worker, prefill.phase, prefill.peer, prefill.batch_id, prefill.batch_ranks) == (
        p,
        "prefill",
        "d0-r0",
        "s1.4",
        2,
    )
    assert (decode.reserve, prefill.reserve) == (Reserved(0, 1, 8), Reserved(100, 0, 0))
