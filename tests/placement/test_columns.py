"""The columns decide as ``costs``'s per-worker functions do: same worker, same random draws."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random

import numpy as np
import pytest

from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.records import Reserved, WorkerLoad
from splitbus.bus.registry import WorkerInfo, WorkerRecord
from splitbus.placement.columns import LoadTable, Tables, decode_row, mixed_costs, pick, prefill_costs
from splitbus.placement.costs import CacheCost, choose, decode_worker, eligible, mixed_cost, prefill_cost, roomy
from splitbus.placement.ledger import JOURNAL_SLACK, Local
from tests.placement.snapshot import worker

COSTS = [CacheCost(), CacheCost(overlap_weight=1.0, load_cap_tokens=500), CacheCost(overlap_weight=0.0)]


def _snapshot(rng: random.Random, n: int) -> list[WorkerInfo]:
    """Workers of both roles, of two models and block sizes, some dead, many near-equal (ties)."""
    rows = []
    for i in range(n):
        total = rng.choice([64, 1000])
        load = WorkerLoad(
            running=rng.randrange(4),
            waiting=rng.randrange(3),
            queued_prefill_tokens=rng.choice([0, 100, 101, 2000, rng.randrange(5000)]),
            free_kv_blocks=rng.choice([0, 5, total, total - 1, rng.randrange(total + 1)]),
            total_kv_blocks=total,
        )
        record = WorkerRecord(
            worker_id=f"w{i}",
            role=rng.choice(["prefill", "decode", "mixed"]),
            model=rng.choice(["m", "m", "m", "other"]),
            block_size=rng.choice([16, 16, 64]),
            load=load,
        )
        held = Reserved(rng.choice([0, 0, 300]), rng.choice([0, 1]), rng.choice([0, 0, 7]))
        rows.append(WorkerInfo(record, 0, rng.choice([3000, 3000, 3000, -2]), held))
    return rows


def _case(seed: int) -> tuple[list[WorkerInfo], GenerateRequest, Local, dict[str, int]]:
    rng = random.Random(seed)
    workers = _snapshot(rng, rng.choice([3, 16, 64]))
    prompt = rng.choice([1, 50, 700, 3000])
    request = GenerateRequest("r", "m", [1] * prompt, SamplingParams(max_tokens=rng.choice([1, 64, 500])), "api", 0)
    local = {w.record.worker_id: Reserved(rng.randrange(500), rng.randrange(3), rng.randrange(9)) for w in workers[::3]}
    cached = {w.record.worker_id: rng.randrange(prompt) for w in workers if rng.random() < 0.3}
    return workers, request, local, cached


@pytest.mark.parametrize("seed", range(60))
def test_decode_row_is_decode_worker(seed: int) -> None:
    workers, request, local, _ = _case(seed)
    for role in ("decode", "mixed"):
        candidates = eligible(workers, "m", role)
        table = LoadTable(candidates)
        row = decode_row(table, table.loads(local), request, random.Random(seed))
        expected = decode_worker(request, candidates, local, random.Random(seed))
        assert (None if row is None else table.workers[row]) is expected


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("cost", COSTS)
def test_the_cost_columns_choose_as_the_cost_functions(seed: int, cost: CacheCost) -> None:
    workers, request, local, cached = _case(seed)
    for role in ("prefill", "mixed"):
        candidates = eligible(workers, "m", role)
        table = LoadTable(candidates)
        loads = table.loads(local)
        every = np.arange(len(table))
        row = pick(every, prefill_costs(table, loads, every, request, cached, cost), random.Random(seed))
        expected = choose(candidates, prefill_cost(candidates, request, cached, local, cost), random.Random(seed))
        assert (None if row is None else table.workers[row]) is expected
        rows = table.roomy(request, loads)
        room = roomy(request, candidates, local)
        assert [table.workers[r] for r in rows] == room
        row = pick(rows, mixed_costs(table, loads, rows, request, cached, cost), random.Random(seed))
        expected = choose(room, mixed_cost(room, request, cached, local, cost), random.Random(seed))
        assert (None if row is None else table.workers[row]) is expected


def test_a_snapshot_table_is_shared_and_local_reservations_never_change_it() -> None:
    workers = _snapshot(random.Random(0), 64)
    tables = Tables()
    table = tables(workers, "m", "decode")
    assert len(table) > 1
    assert tables(workers, "m", "decode") is table  # the same snapshot: built once
    assert tables(list(workers), "m", "decode") is table  # a new snapshot, no row changed: kept
    gone = [dataclasses.replace(w, lease_ttl_ms=-2) if w is table.workers[0] else w for w in workers]
    assert tables(gone, "m", "decode") is not table  # a worker left it: built anew
    table = tables(workers, "m", "decode")
    before = table.loads({}).free.copy()
    mine = Local({w.record.worker_id: Reserved(0, 0, 5) for w in table.workers})
    assert (table.loads(mine).free == before - 5).all()
    assert (table.loads({}).free == before).all()
    table.loads({}).free[0] += 1  # a copy
    assert (table.loads({}).free == before).all()


def test_the_columns_follow_a_locals_journal_through_every_kind_of_change() -> None:
    """Each decision's columns, kept by following the journal, equal columns computed afresh
    from the whole mapping, whatever the ledger did in between."""
    rng = random.Random(5)
    workers = _snapshot(rng, 48)
    tables = [LoadTable(eligible(workers, "m", role)) for role in ("prefill", "decode", "mixed")]
    ids = [w.record.worker_id for w in workers] + ["gone"]
    local = Local()
    for step in range(600):
        action = rng.random()
        worker = rng.choice(ids)
        if action < 0.7:
            mine = local.get(worker, Reserved())
            local[worker] = Reserved(mine.reserved_prefill_tokens + 10, mine.reserved_requests + 1, 2)
        elif action < 0.8:
            local.pop(worker, None)
        elif action < 0.85:
            local.clear()
        elif action < 0.9:
            local.update({worker: Reserved(1, 1, 1)})
        elif action < 0.95:
            local.setdefault(worker, Reserved(3, 0, 0))
        elif worker in local:
            del local[worker]
        for table in tables:
            kept, fresh = table.loads(local), table.loads(dict(local))
            for name in ("free", "queued", "active"):
                assert (getattr(kept, name) == getattr(fresh, name)).all(), (step, name)


def test_a_locals_journal_starts_over_before_it_grows_past_its_bound() -> None:
    local = Local()
    for i in range(1000):
        local["w"] = Reserved(i, 0, 0)
    assert len(local.journal) <= 4 + JOURNAL_SLACK + 1
    assert local.epoch > 0


def _changed(rng: random.Random, w: WorkerInfo) -> WorkerInfo:
    """A newer row of ``w``: new load, or dead, or another role, model or block size."""
    roll, record = rng.random(), w.record
    load = dataclasses.replace(
        record.load, free_kv_blocks=rng.randrange(1000), queued_prefill_tokens=rng.randrange(900)
    )
    if roll < 0.7:
        return WorkerInfo(dataclasses.replace(record, load=load), 0, w.lease_ttl_ms, Reserved(0, rng.randrange(2), 0))
    if roll < 0.8:
        return WorkerInfo(record, 0, -2 if w.alive else 3000, w.reserved)
    if roll < 0.9:
        return WorkerInfo(dataclasses.replace(record, role=rng.choice(["prefill", "decode"])), 0, 3000, w.reserved)
    return WorkerInfo(dataclasses.replace(record, block_size=rng.choice([16, 64])), 0, w.lease_ttl_ms, w.reserved)


def test_tables_follow_changed_rows_as_tables_built_afresh() -> None:
    """Snapshots as a registry view makes them (changed rows replaced in place, now and then a
    worker more or fewer): the tables kept by following them equal tables built from each."""
    rng = random.Random(11)
    workers = _snapshot(rng, 40)
    tables, local = Tables(), Local({"w1": Reserved(5, 1, 3)})
    for step in range(300):
        workers = list(workers)
        roll = rng.random()
        if roll < 0.05:
            workers.append(_snapshot(rng, 1)[0].__class__(*_snapshot(rng, 1)[0].__dict__.values()))
            workers[-1] = dataclasses.replace(
                workers[-1], record=dataclasses.replace(workers[-1].record, worker_id=f"n{step}")
            )
        elif roll < 0.1:
            workers.pop(rng.randrange(len(workers)))
        else:
            for i in rng.sample(range(len(workers)), rng.choice([1, 2, 5, 15])):
                workers[i] = _changed(rng, workers[i])
        local[f"w{rng.randrange(40)}"] = Reserved(rng.randrange(50), 1, rng.randrange(4))
        for model, role in (("m", "prefill"), ("m", "decode"), ("m", "mixed"), ("other", "decode")):
            kept, fresh = tables(workers, model, role), LoadTable(eligible(workers, model, role))
            assert kept.workers == fresh.workers, step
            assert (kept.block_size == fresh.block_size).all() and (kept.total == fresh.total).all()
            a, b = kept.loads(local), fresh.loads(dict(local))
            for name in ("free", "queued", "active"):
                assert (getattr(a, name) == getattr(b, name)).all(), (step, role, name)


def test_a_copied_local_keeps_a_journal_of_its_own() -> None:
    table = LoadTable([worker("a", "decode"), worker("b", "decode")])
    local = Local({"a": Reserved(0, 1, 5)})
    table.loads(local)
    for twin in (copy.copy(local), copy.deepcopy(local), pickle.loads(pickle.dumps(local)), local.copy()):
        assert isinstance(twin, Local) and twin == local and twin.journal is not local.journal
        twin["b"] = Reserved(0, 1, 7)
    assert local.journal == ["a"] and list(table.loads(local).free) == [995, 1000]


def test_a_list_changed_in_place_and_passed_again_is_seen_changed() -> None:
    tables = Tables()
    rows = [worker("a", "mixed", free=1000), worker("b", "mixed", free=10)]
    assert list(tables(rows, "m", "mixed").loads({}).free) == [1000, 10]
    rows[0] = worker("a", "mixed", free=0)
    assert list(tables(list(rows), "m", "mixed").loads({}).free) == [0, 10]
