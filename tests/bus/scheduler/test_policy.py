"""Placement on hand-made registry snapshots (pure logic)."""

from __future__ import annotations

import random
from collections import Counter

from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.registry import Reserved, WorkerInfo, WorkerLoad, WorkerRecord
from splitbus.bus.scheduler.policy import Policy, blocks_needed


def worker(
    wid: str,
    role: str,
    queued: int = 0,
    free: int = 1000,
    running: int = 0,
    alive: bool = True,
    model: str = "m",
    reserved: Reserved | None = None,
) -> WorkerInfo:
    load = WorkerLoad(running=running, queued_prefill_tokens=queued, free_kv_blocks=free, total_kv_blocks=1000)
    record = WorkerRecord(worker_id=wid, role=role, model=model, load=load)
    return WorkerInfo(record, 0, 3000 if alive else -2, reserved or Reserved())


def request(prompt: int = 100, max_tokens: int = 28) -> GenerateRequest:
    return GenerateRequest("r", "m", [1] * prompt, SamplingParams(max_tokens=max_tokens), "api", 0)


def test_prefill_by_queued_tokens_and_decode_by_free_blocks() -> None:
    workers = [
        worker("p-busy", "prefill", queued=5000),
        worker("p-idle", "prefill", queued=10),
        worker("d-full", "decode", free=50),
        worker("d-roomy", "decode", free=900),
    ]
    plan = Policy("splitwise", random.Random(0)).place(request(), workers, {})
    assert not isinstance(plan, str)
    decode, prefill = plan
    assert (decode.worker.record.worker_id, decode.phase, decode.peer) == ("d-roomy", "decode", "p-idle")
    assert (prefill.worker.record.worker_id, prefill.phase, prefill.peer) == ("p-idle", "prefill", "d-roomy")
    assert prefill.reserve == Reserved(reserved_prefill_tokens=100)
    assert (
        decode.reserve
        == Reserved(reserved_requests=1, reserved_kv_blocks=blocks_needed(request(), 16))
        == Reserved(0, 1, 8)
    )


def test_decode_ties_on_blocks_go_to_fewer_running() -> None:
    workers = [
        worker("p", "prefill"),
        worker("d-a", "decode", free=900, running=30),
        worker("d-b", "decode", free=880, running=2),
    ]
    plan = Policy("splitwise", random.Random(1)).place(request(), workers, {})
    assert not isinstance(plan, str) and plan[0].worker.record.worker_id == "d-b"


def test_reservations_count_as_load() -> None:
    workers = [
        worker("p-a", "prefill", queued=0, reserved=Reserved(reserved_prefill_tokens=8000)),
        worker("p-b", "prefill", queued=500),
        worker("d", "decode"),
    ]
    plan = Policy("splitwise").place(request(), workers, {"p-b": Reserved()})
    assert not isinstance(plan, str) and plan[1].worker.record.worker_id == "p-b"
    local = {"p-b": Reserved(reserved_prefill_tokens=20000)}  # this replica's own recent picks
    plan = Policy("splitwise").place(request(), workers, local)
    assert not isinstance(plan, str) and plan[1].worker.record.worker_id == "p-a"


def test_near_equal_candidates_are_spread() -> None:
    workers = [worker(f"p{i}", "prefill", queued=100 + i) for i in range(4)] + [worker("d", "decode")]
    policy = Policy("splitwise", random.Random(7))
    picks = Counter(policy.place(request(), workers, {})[1].worker.record.worker_id for _ in range(400))  # type: ignore[index]
    assert set(picks) == {"p0", "p1", "p2", "p3"}
    assert min(picks.values()) > 50


def test_no_placement_says_why() -> None:
    policy = Policy("splitwise")
    assert "no live prefill worker" in policy.place(request(), [worker("d", "decode")], {})  # type: ignore[operator]
    dead = [worker("p", "prefill"), worker("d", "decode", alive=False)]
    assert "no live decode worker" in policy.place(request(), dead, {})  # type: ignore[operator]
    full = [worker("p", "prefill"), worker("d", "decode", free=3)]
    assert "decode" in policy.place(request(), full, {})  # type: ignore[operator]
    other_model = [worker("p", "prefill", model="x"), worker("d", "decode", model="x")]
    assert "model 'm'" in policy.place(request(), other_model, {})  # type: ignore[operator]


def test_mixed_mode_uses_one_mixed_worker() -> None:
    workers = [worker("x", "mixed", free=100), worker("y", "mixed", free=800), worker("p", "prefill")]
    plan = Policy("mixed", random.Random(0)).place(request(), workers, {})
    assert not isinstance(plan, str)
    assert [(p.worker.record.worker_id, p.phase, p.peer) for p in plan] == [("y", "mixed", "")]
    assert plan[0].reserve == Reserved(100, 1, 8)
