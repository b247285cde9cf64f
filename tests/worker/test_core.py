"""The worker's core (splitbus/worker/core.py) as pure functions: tasks and KV arrivals in, a
plan and its tokens, effects out. A sim engine holds the blocks; there is no Redis and no loop
but the one the engine's own (async) calls run on, as the shell runs them."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.bus.messages import GenerateRequest, SamplingParams, Task, TokenDelta
from splitbus.bus.records import Reserved
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.core import AdmissionFailed, HandOffEnd, Limits, WorkerCore, first_priority
from splitbus.worker.effects import (
    Ack,
    CancelPeer,
    DeadLetter,
    Discard,
    DropReservation,
    Effect,
    Emit,
    Fail,
    Finish,
    Forget,
    Left,
    Open,
    ShipKv,
    Wake,
)
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.kv_proof import Header, kv_proof
from splitbus.worker.sequence import Sequence
from splitbus.worker.table import Status
from splitbus.worker.transfer import KV

FREE = SimConfig(prefill_s_per_token=0, decode_step_s=0, decode_s_per_seq=0)
BLOCKS = 16


@pytest.fixture
def core(tiny_model: Path) -> WorkerCore:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    return WorkerCore(
        Limits("w1", "tiny", block_size=16, kv_wait_s=30.0), SimEngine(FREE, tokenizer, BLOCKS, 16), tokenizer
    )


def task(
    phase: str,
    request_id: str = "r1",
    max_tokens: int = 4,
    *,
    prompt: int = 2,
    reserved: tuple[int, int, int] = (0, 0, 0),
    handoff: str = "",
    deadline_ms: int = 0,
    model: str = "tiny",
    priority: int = 0,
    token: int = 97,
) -> Task:
    sampling = SamplingParams(max_tokens=max_tokens)
    request = GenerateRequest(request_id, model, [token] * prompt, sampling, "api", deadline_ms, priority=priority)
    peer = "" if phase == "mixed" else ("d1" if phase == "prefill" else "p1")
    return Task(phase, request, peer, reserved=list(reserved), handoff=handoff)


def taken(core: WorkerCore, entry_id: str, t: Task) -> Sequence:
    admission = core.admit(entry_id, t)
    assert admission.rejected is None
    seq = core.table.get(t.request.request_id)
    assert seq is not None
    return seq


async def prefill(core: WorkerCore) -> list[Effect]:
    """One prefill step as the shell runs it: the plan, the engine call, the postprocess."""
    batch = core.plan_prefill()
    return core.end_prefill(list(zip(batch, await core.engine.prefill(batch), strict=True)))


async def decode(core: WorkerCore) -> list[Effect]:
    batch = core.plan_decode()
    return core.end_decode(list(zip(batch, await core.engine.decode(batch), strict=True)))


def kinds(effects: list[Effect]) -> list[type]:
    return [type(e) for e in effects]


# ---------------------------------------------------------------- what a task comes to


def test_a_task_that_prefills_is_queued_without_blocks_and_its_reservation_goes_back(core: WorkerCore) -> None:
    admission = core.admit("1-0", task("mixed", reserved=(2, 1, 1)))
    assert admission.effects == [Open("r1", "api", 0)] and admission.reserved == Reserved(2, 1, 1)
    assert admission.rejected is None and admission.awaiting_kv is None
    assert core.table.count(Status.QUEUED) == 1 and core.engine.free_blocks == BLOCKS


def test_an_entry_that_is_not_a_task_is_rejected(core: WorkerCore) -> None:
    assert core.admit("1-0", TokenDelta(0, [1], "x")).rejected == ("handler_failed", "a TokenDelta entry is not a task")
    assert len(core.table) == 0


def test_a_task_claiming_more_than_a_scheduler_reserves_is_rejected_and_nothing_goes_back(core: WorkerCore) -> None:
    admission = core.admit("1-0", task("prefill", reserved=(2, 1, 0)))  # a prefill task reserves no request
    assert admission.reserved is None and admission.rejected is not None
    assert admission.rejected[0] == "invalid_task" and "exceeds what a prefill task" in admission.rejected[1]


def test_a_task_for_another_model_is_rejected_but_its_reservation_goes_back(core: WorkerCore) -> None:
    admission = core.admit("1-0", task("mixed", model="other", reserved=(2, 1, 1)))
    assert admission.reserved == Reserved(2, 1, 1)
    assert admission.rejected == ("invalid_task", "the task is for model 'other'; this worker serves 'tiny'")


def test_a_task_of_a_request_cancelled_lately_is_acked(core: WorkerCore) -> None:
    assert core.cancel("r1") == []  # nothing held yet
    assert core.admit("1-0", task("mixed")).effects == [Ack("1-0")] and len(core.table) == 0


def test_a_copy_of_a_held_tasks_dispatch_is_acked_and_the_held_one_kept(core: WorkerCore) -> None:
    held = taken(core, "1-0", task("prefill", handoff="h1"))
    assert core.admit("2-0", task("prefill", handoff="h1")).effects == [Ack("2-0")]
    assert core.table.of() == [held]


def test_a_request_moved_here_again_keeps_only_its_newest_task(core: WorkerCore) -> None:
    older = taken(core, "1-0", task("prefill", handoff="h1"))
    admission = core.admit("2-0", task("prefill", handoff="h2"))
    assert admission.effects == [Wake(), Forget("r1"), Ack("1-0"), Left(), Discard("r1"), Open("r1", "api", 0)]
    (newer,) = core.table.of(Status.QUEUED)
    assert newer is not older and newer.entry_id == "2-0"


def test_a_task_the_reaper_holds_is_dropped_without_an_ack(core: WorkerCore) -> None:
    """A worker back from a hang drops the tasks no longer pending to it: a reaper holds them
    (moved, or kept for the DP group to re-form). Its ack would take a kept task from the
    reaper (XACK acks for the whole group): the reaper acks it itself once it moves it."""
    kept = taken(core, "1-0", task("prefill", handoff="h1"))
    assert core.moved_away(kept, reapers=True) == [Wake(), Forget("r1"), Left(), Discard("r1")]
    assert core.table.of() == []
    found = taken(core, "2-0", task("prefill", handoff="h2"))  # found superseded otherwise: acked here
    assert core.moved_away(found) == [Wake(), Forget("r1"), Ack("2-0"), Left(), Discard("r1")]


def test_a_task_found_moved_that_left_meanwhile_is_not_retired_again(core: WorkerCore) -> None:
    # The task feed finds what moved away, awaits Redis (a new run's missing entries), then
    # drops each: meanwhile the request moved here again, its older task retired as its newer
    # one was taken. Dropping the older again would ack it twice and forget the newer's writer.
    older = taken(core, "1-0", task("prefill", handoff="h1"))
    newer = taken(core, "2-0", task("prefill", handoff="h2"))
    assert core.moved_away(older) == []
    assert core.table.of() == [newer]


def test_an_engine_that_raises_as_a_task_is_taken_leaves_what_was_done_to_go_through(
    core: WorkerCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The older task of the request is already out of the table, its blocks freed, and the
    # newer one's stream opened: those effects and the reservation must still go through
    # (acked, given back), then the task fails alone.
    older = taken(core, "1-0", task("prefill", handoff="h1"))

    def broken(t: Task) -> int:
        raise RuntimeError("engine bug")

    monkeypatch.setattr(core.engine, "cached_prefix", broken)
    with pytest.raises(AdmissionFailed) as failed:
        core.admit("2-0", task("prefill", handoff="h2", reserved=(2, 0, 0)))
    assert str(failed.value.cause) == "engine bug" and failed.value.so_far.reserved == Reserved(2, 0, 0)
    assert failed.value.so_far.effects == [
        Wake(),
        Forget("r1"),
        Ack("1-0"),
        Left(),
        Discard("r1"),
        Open("r1", "api", 0),
    ]
    assert core.table.status(older) is None and len(core.table) == 0


def test_a_decode_task_takes_its_blocks_and_waits_for_its_kv(core: WorkerCore) -> None:
    core.endpoint = "127.0.0.1:7"
    admission = core.admit("1-0", task("decode", max_tokens=30, handoff="h1"))
    seq = admission.awaiting_kv
    assert seq is not None and admission.effects == [] and core.table.status(seq) is Status.AWAITING_KV
    assert seq.blocks == 2 and core.engine.free_blocks == BLOCKS - 2 and len(seq.kv_secret) == 64
    reservation = core.reservation_of(seq)
    assert (reservation.decode_worker, reservation.endpoint, reservation.blocks) == ("w1", "127.0.0.1:7", 2)
    assert (reservation.prefill_worker, reservation.secret, reservation.handoff) == ("p1", seq.kv_secret, "h1")


def test_a_decode_task_without_blocks_fails_and_one_that_never_fits_is_taken_to_fail(core: WorkerCore) -> None:
    taken(core, "1-0", task("decode", "big", max_tokens=200))  # 13 of the 16 blocks
    assert not core.kv_room_for(task("decode", "r2", max_tokens=100))  # it waits, read, for a request to leave
    assert core.kv_room_for(task("mixed", "r3", max_tokens=100))  # a prefill takes its blocks later
    admission = core.admit("2-0", task("decode", "r2", max_tokens=100))
    assert kinds(admission.effects) == [Fail, Forget, Ack, DropReservation, Left]
    failed = admission.effects[0]
    assert isinstance(failed, Fail) and (failed.code, failed.status) == ("out_of_kv_blocks", 503)


def test_a_prompt_larger_than_the_whole_cache_fails_as_it_is_queued(core: WorkerCore) -> None:
    admission = core.admit("1-0", task("mixed", prompt=250, max_tokens=20))
    assert kinds(admission.effects) == [Open, Fail, Forget, Ack, Left] and len(core.table) == 0
    assert "has 16 KV blocks in all, not enough for 270 tokens" in admission.effects[1].message  # type: ignore[union-attr]


def test_a_dead_lettered_task_fails_its_request_unless_it_is_held(core: WorkerCore) -> None:
    assert core.fail_unheld("r9", "invalid_task: bad", reader="api") == [
        Fail(
            "r9", "invalid_task", "worker w1 could not handle this request's task: invalid_task: bad", 500, "api", False
        )
    ]
    taken(core, "1-0", task("mixed"))
    assert core.fail_unheld("r1", "invalid_task: bad", reader="api") == []


# ---------------------------------------------------------------- the step


async def test_a_mixed_request_prefills_decodes_and_finishes(core: WorkerCore) -> None:
    seq = taken(core, "1-0", task("mixed", max_tokens=3))
    first = await prefill(core)
    assert kinds(first) == [Emit] and core.table.status(seq) is Status.RUNNING and seq.blocks
    assert core.counters["prefills_done"] == 1 and core.has_work()
    assert kinds(await decode(core)) == [Emit]
    last = await decode(core)
    assert kinds(last) == [Emit, Finish, Forget, Ack, Left] and len(core.table) == 0
    finish = last[1]
    assert isinstance(finish, Finish) and (finish.reason, finish.prompt_tokens, finish.completion_tokens) == (
        "length",
        2,
        3,
    )
    assert core.counters["decodes_done"] == 1 and core.engine.free_blocks == BLOCKS and not core.has_work()


async def test_a_prefill_workers_request_is_shipped_or_finished_at_its_first_token(core: WorkerCore) -> None:
    shipped = taken(core, "1-0", task("prefill", "r1", max_tokens=4))
    done = taken(core, "2-0", task("prefill", "r2", max_tokens=1))
    effects = await prefill(core)
    assert ShipKv(shipped) in effects and core.table.status(shipped) is Status.HANDING_OFF
    assert effects[-1] == CancelPeer("r2", "finished_on_prefill") and core.table.status(done) is None
    assert kinds(core.hand_off_ended(shipped)) == [Wake] and len(core.table) == 0


async def handing_off(core: WorkerCore, count: int) -> list[Sequence]:
    seqs = [taken(core, f"{i}-0", task("prefill", f"r{i}", max_tokens=4)) for i in range(count)]
    await prefill(core)
    assert all(core.table.status(seq) is Status.HANDING_OFF for seq in seqs)
    return seqs


async def test_a_hand_off_shipped_or_to_a_gone_peer_lets_go_and_a_bug_fails_its_request(core: WorkerCore) -> None:
    shipped, gone, broken = await handing_off(core, 3)
    assert core.hand_off_outcome(shipped, HandOffEnd.SHIPPED, None) == [Forget("r0"), Ack("0-0"), Left()]
    assert core.hand_off_outcome(gone, HandOffEnd.PEER_GONE, RuntimeError("d1 is dead")) == [
        Forget("r1"),
        Ack("1-0"),
        Left(),
    ]
    effects = core.hand_off_outcome(broken, HandOffEnd.BROKEN, KeyError("x"))
    assert effects[0] == Fail("r2", "handler_failed", "the KV hand-off failed: KeyError: 'x'", 500, "api")
    assert kinds(effects) == [Fail, Forget, Ack, Left]
    assert core.table.of(Status.HANDING_OFF) == [shipped, gone, broken]  # until each hand-off has ended


async def test_a_refused_hand_off_fails_and_cancels_unless_dispatched_again(core: WorkerCore) -> None:
    refused, superseded = await handing_off(core, 2)
    effects = core.hand_off_outcome(refused, HandOffEnd.REFUSED, TimeoutError("kv wait"))
    assert effects[0] == Fail("r0", "kv_transfer_failed", "could not hand the KV cache to d1: kv wait", 503, "api")
    assert kinds(effects) == [Fail, Forget, Ack, Left, CancelPeer] and effects[-1] == CancelPeer(
        "r0", "kv_transfer_failed"
    )
    assert core.hand_off_outcome(superseded, HandOffEnd.REFUSED, TimeoutError("x"), superseded=True) == [
        Forget("r1"),
        Ack("1-0"),
        Left(),
    ]


async def test_a_hand_off_whose_request_left_meanwhile_comes_to_nothing(core: WorkerCore) -> None:
    (seq,) = await handing_off(core, 1)
    assert core.moved_away(seq) != []
    for end in HandOffEnd:
        assert core.hand_off_outcome(seq, end, RuntimeError("late")) == []


def test_queued_requests_with_no_blocks_to_prefill_into_block_the_plan(core: WorkerCore) -> None:
    taken(core, "1-0", task("decode", "big", max_tokens=200))
    queued = taken(core, "2-0", task("mixed", "r2", prompt=50, max_tokens=100))
    assert core.plan_prefill() == [] and core.kv_blocked and not core.has_work()
    assert core.table.of(Status.QUEUED) == [queued]


async def test_a_request_that_left_during_the_engine_call_gets_no_token(core: WorkerCore) -> None:
    kept, cancelled = taken(core, "1-0", task("mixed", "r1")), taken(core, "2-0", task("mixed", "r2"))
    await prefill(core)
    batch = core.plan_decode()
    tokens = await core.engine.decode(batch)
    assert kinds(core.cancel("r2")) == [Forget, Ack, Left, Wake]  # while the engine ran
    effects = core.end_decode(list(zip(batch, tokens, strict=True)))
    assert [e.request_id for e in effects if isinstance(e, Emit)] == [kept.request_id]
    assert core.table.status(cancelled) is None


async def test_blocks_are_looked_for_again_once_the_engine_loop_waited(core: WorkerCore) -> None:
    big = taken(core, "1-0", task("decode", "big", max_tokens=200))
    taken(core, "2-0", task("mixed", "r2", prompt=50, max_tokens=100))
    assert core.plan_prefill() == [] and not core.has_work()
    core.look_for_blocks_again()
    assert not core.kv_blocked and core.has_work()  # the next plan looks (and may find none again)
    assert core.plan_prefill() == [] and core.kv_blocked
    assert core.drop_task(big.entry_id) != [] and core.plan_prefill() != []


async def test_a_broken_groups_mixed_rank_fails_what_is_queued_or_running(core: WorkerCore) -> None:
    running = taken(core, "1-0", task("mixed", "r1", max_tokens=8))
    await prefill(core)
    queued = taken(core, "2-0", task("mixed", "r2"))
    waiting = core.admit("3-0", task("decode", "r3")).awaiting_kv
    effects = core.group_broken("dp group g1 broke: rank 1 is gone")
    assert kinds(effects) == [Fail, Forget, Ack, Left] * 2
    assert effects[0] == Fail("r1", "dp_group_broken", "dp group g1 broke: rank 1 is gone", 503, "api")
    assert core.table.status(running) is None and core.table.status(queued) is None
    assert core.table.of() == [waiting]


def test_a_prefill_that_did_not_end_is_queued_again_first_in_line(core: WorkerCore) -> None:
    first, second = taken(core, "1-0", task("mixed", "r1")), taken(core, "2-0", task("mixed", "r2"))
    assert core.plan_prefill() == [first, second]
    later = taken(core, "3-0", task("mixed", "r3"))
    core.abort_prefill()
    assert core.table.of(Status.QUEUED) == [first, second, later] and first.blocks and second.blocks


async def test_a_request_of_a_higher_priority_passes_the_queue_and_waits_first_for_blocks(
    tiny_model: Path,
) -> None:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    engine = SimEngine(FREE, tokenizer, 4, 16)  # 4 blocks of 16: one 40-token prompt (3) at a time
    core = WorkerCore(Limits("w1", "tiny", block_size=16, max_prefill_tokens=40), engine, tokenizer)
    low = taken(core, "1-0", task("mixed", "low", prompt=40, priority=1))
    await prefill(core)
    assert core.table.status(low) is Status.RUNNING and core.engine.free_blocks == 1
    others = [taken(core, f"{i}-0", task("mixed", f"r{i}", prompt=8, priority=1)) for i in (2, 3)]
    high = taken(core, "4-0", task("mixed", "high", prompt=40, priority=-1, token=98))  # no prefix cached
    assert core.prefill_batch_size() == (1, 40) and core.plan_prefill() == [] and core.kv_blocked
    assert core.table.of(Status.QUEUED) == [*others, high]  # the small ones, which would fit, wait behind it
    core.cancel("low")
    core.look_for_blocks_again()
    assert core.plan_prefill() == [high] and core.table.of(Status.QUEUED) == others  # its 40 tokens fill the batch


def test_a_poisoned_request_fails_unless_it_left_meanwhile(core: WorkerCore) -> None:
    seq = taken(core, "1-0", task("mixed"))
    assert core.poison_letter(seq, ValueError("bad request")) == DeadLetter(
        "1-0", seq.task, "engine_error: bad request"
    )
    assert core.table.status(seq) is Status.QUEUED  # held until its letter is written
    effects = core.poisoned(seq, ValueError("bad request"))
    assert kinds(effects) == [Fail, Forget, Ack, Left]
    assert effects[0] == Fail("r1", "engine_error", "the engine failed on this request: bad request", 500, "api")
    assert core.poisoned(seq, ValueError("again")) == []


# ---------------------------------------------------------------- how requests leave on their own


def test_a_request_past_its_deadline_fails(core: WorkerCore) -> None:
    seq = taken(core, "1-0", task("mixed", deadline_ms=1_000_000))
    core.wall = lambda: 999.0
    assert core.deadlines_past() == []
    core.wall = lambda: 1001.0
    effects = core.deadlines_past()
    assert kinds(effects) == [Fail, Forget, Ack, Left] and core.table.status(seq) is None
    assert (effects[0].code, effects[0].status) == ("deadline", 504)  # type: ignore[union-attr]


def test_a_kv_wait_that_ran_out_fails_unless_its_request_moved(core: WorkerCore) -> None:
    now = [100.0]
    core.clock = lambda: now[0]
    seq = core.admit("1-0", task("decode", "r1")).awaiting_kv
    moved = core.admit("2-0", task("decode", "r2")).awaiting_kv
    assert seq is not None and moved is not None and core.kv_waits_past() == []
    now[0] = 131.0
    assert core.kv_waits_past() == [seq, moved] and len(core.table) == 0
    assert kinds(core.kv_wait_ended(seq, moved=False)) == [Fail, Forget, Ack, DropReservation, Left, Wake]
    assert kinds(core.kv_wait_ended(moved, moved=True)) == [Forget, Ack, DropReservation, Left]


def test_a_cancel_naming_a_task_entry_drops_that_task_only(core: WorkerCore) -> None:
    waiting = core.admit("1-0", task("decode", "r1")).awaiting_kv
    assert waiting is not None and core.drop_task("9-0") == []
    assert kinds(core.drop_task("1-0")) == [Forget, Ack, DropReservation, Left, Wake] and len(core.table) == 0


# ---------------------------------------------------------------- KV arrivals


def frame(seq: Sequence, sender: str, meta: dict[str, object], size: int = 64) -> Header:
    proof = kv_proof(seq.kv_secret, sender, seq.request_id, meta, size, 0)
    return Header(KV, seq.request_id, {**meta, "proof": proof}, size, 0)


def test_a_kv_frame_from_a_stranger_is_refused_and_changes_nothing(core: WorkerCore) -> None:
    seq = core.admit("1-0", task("decode")).awaiting_kv
    assert seq is not None
    refusal, effects = core.admit_kv("p2", frame(seq, "p2", {"output_token_ids": [97], "next_seq": 1}))
    assert refusal is not None and effects == [] and core.table.status(seq) is Status.AWAITING_KV


def test_a_proven_frame_with_meta_p_could_not_send_fails_the_request(core: WorkerCore) -> None:
    seq = core.admit("1-0", task("decode")).awaiting_kv
    assert seq is not None
    refusal, effects = core.admit_kv("p1", frame(seq, "p1", {"output_token_ids": [97], "next_seq": 5}))
    assert refusal is not None and refusal.startswith("next_seq must be 1")
    assert kinds(effects) == [Fail, Forget, Ack, DropReservation, Left, Wake] and len(core.table) == 0


def test_an_imported_request_runs_from_the_tokens_p_made(core: WorkerCore) -> None:
    seq = core.admit("1-0", task("decode")).awaiting_kv
    assert seq is not None
    meta: dict[str, object] = {"output_token_ids": [97], "next_seq": 1, "cached_tokens": 2}
    assert core.admit_kv("p1", frame(seq, "p1", meta)) == (None, [])
    assert core.start_import("r1") is seq and core.table.status(seq) is Status.IMPORTING
    assert core.end_import(seq, meta, None) == (None, [Open("r1", "api", 1), Wake()])
    assert core.table.status(seq) is Status.RUNNING and seq.output_ids == [97] and seq.prompt_cached == 2


def test_an_import_whose_request_moved_here_again_lets_its_task_go(core: WorkerCore) -> None:
    older = core.admit("1-0", task("decode", handoff="h1")).awaiting_kv
    assert older is not None
    core.start_import("r1")
    assert core.admit("2-0", task("decode", handoff="h2")).effects == [Wake()]  # the importing one only leaves
    refusal, effects = core.end_import(older, {}, None)
    assert refusal is not None and "moved" in refusal
    assert effects == [Ack("1-0"), DropReservation("r1", "1-0"), Left()]


def test_the_load_counts_what_the_table_holds(core: WorkerCore) -> None:
    taken(core, "1-0", task("mixed", "r1", prompt=40))
    core.admit("2-0", task("decode", "r2"))
    load = core.load()
    assert (load.running, load.waiting, load.queued_prefill_tokens) == (0, 2, 40)
    assert (load.free_kv_blocks, load.total_kv_blocks) == (BLOCKS - 1, BLOCKS)
    assert load.first_queued_priority == 0
    taken(core, "3-0", task("mixed", "r3", prompt=4, priority=-7))
    taken(core, "4-0", task("mixed", "r4", prompt=4, priority=3))
    assert core.load().first_queued_priority == -7  # the request first in the prefill queue
    assert first_priority(None) == 0
    holder = core.table.get("r4")
    assert holder is not None
    holder.blocks = 1  # an aborted batch's: it goes first, and nothing could head the queue before it
    assert core.load().first_queued_priority == -(2**31)


async def test_prefills_count_their_prompt_tokens_and_those_a_prefix_cache_held(core: WorkerCore) -> None:
    """The planner's inputs (``WorkerLoad.prompt_tokens_done``, ``prompt_tokens_cached``)."""
    taken(core, "1-0", task("mixed", "first", max_tokens=1, prompt=40))
    await prefill(core)  # done at its first token: its blocks go back to the cache
    second = taken(core, "2-0", task("mixed", "second", max_tokens=1, prompt=40))
    await prefill(core)
    assert second.prompt_cached == 32  # its two full blocks: the last, partial one is computed again
    assert (core.counters["prompt_tokens_done"], core.counters["prompt_tokens_cached"]) == (80, 32)
    assert (core.load().prompt_tokens_done, core.load().prompt_tokens_cached) == (80, 32)


def test_a_draining_core_says_so_in_every_load_it_reports(core: WorkerCore) -> None:
    assert core.load().draining == 0
    core.draining = True
    taken(core, "1-0", task("mixed", "r1", prompt=40))
    assert core.load().draining == 1
