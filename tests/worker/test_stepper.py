"""The stepper a worker is given: a worker on its own, or a rank of a DP group, against a real
Redis; and the loops the worker runs them under."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import WORKER_GROUP
from splitbus.bus.messages import Failed, Finished, GenerateRequest, SamplingParams, Task, TokenDelta
from splitbus.bus.registry import Registry
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.dp import EXIT_GROUP_BROKEN, DpStepper, GroupBroken, StepPlan
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.sequence import Sequence
from splitbus.worker.steps import SoloStepper, StepperFactory
from splitbus.worker.table import Status
from splitbus.worker.text import TextStream
from splitbus.worker.worker import Worker
from tests.worker import replies
from tests.worker.replies import decoded


def mixed_worker(
    bus_config: BusConfig, tiny_model: Path, stepper: StepperFactory = SoloStepper, dp_size: int = 0
) -> Worker:
    """A mixed worker; with ``dp_size``, rank 0 of DP group g0."""
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(
        bus=bus_config,
        role="mixed",
        model_dir=tiny_model,
        model_name="tiny",
        worker_id="m0",
        dp_group="g0" if dp_size else "",
        dp_rank=0 if dp_size else -1,
        dp_size=dp_size,
    )
    return Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 64, 16), stepper)


def dp_worker(bus_config: BusConfig, tiny_model: Path) -> Worker:
    return mixed_worker(bus_config, tiny_model, DpStepper, dp_size=2)


def ep_rank(bus_config: BusConfig, tiny_model: Path, rank: int, costs: SimConfig) -> Worker:
    """Rank ``rank`` of DP group g-ep (2 ranks), its group formed (epoch 1), on a sim engine."""
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(
        bus=bus_config,
        role="mixed",
        model_dir=tiny_model,
        model_name="tiny",
        worker_id=f"ep{rank}",
        dp_group="g-ep",
        dp_rank=rank,
        dp_size=2,
    )
    worker = Worker(config, tokenizer, SimEngine(costs, tokenizer, 64, 16), DpStepper)
    assert isinstance(worker.stepper, DpStepper)
    worker.stepper.barrier.begin(epoch_ms=1)
    return worker


def queue(
    worker: Worker,
    request_id: str,
    max_tokens: int = 4,
    batch: str = "",
    entry: str = "1-0",
    prompt: int = 2,
    priority: int = 0,
) -> Sequence:
    """A mixed task taken (a ``prompt``-token prompt): its writer open, queued to prefill (its blocks
    are taken as its prefill starts, as the core queues one)."""
    sampling = SamplingParams(max_tokens=max_tokens)
    request = GenerateRequest(request_id, "tiny", [97, 98] * (prompt // 2), sampling, "api", 0, priority=priority)
    task = Task("mixed", request, batch_id=batch, batch_ranks=2 if batch else 0)
    seq = Sequence(task, entry, TextStream(worker.tokenizer, []))
    worker.writer.open(request_id, reader=request.reader)
    worker.requests.add(seq, Status.QUEUED)
    return seq


async def entries(worker: Worker, request_id: str) -> list[object]:
    await worker.publisher.publish()
    return await decoded(worker.redis, worker.keys.out("api", request_id))


async def test_a_solo_step_prefills_then_decodes_and_a_finished_request_leaves(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    worker = mixed_worker(bus_config, tiny_model)
    done, going = queue(worker, "r-two", max_tokens=2, entry="1-0"), queue(worker, "r-four", entry="2-0")
    free = worker.engine.free_blocks
    try:
        await worker.stepper.step()  # one prefill (a token each), then one decode (one more each)
        assert worker.requests.of() == [going] and worker.requests.status(going) is Status.RUNNING
        assert worker.outbox.done_entries == ["1-0"]
        assert going.blocks > 0 and worker.engine.free_blocks == free - going.blocks  # r-two's blocks are back
        got = await entries(worker, "r-two")
        assert [type(e) for e in got] == [TokenDelta, TokenDelta, Finished]
        assert len(await entries(worker, "r-four")) == 2 and done.finished
    finally:
        await worker.loops.close()
        await worker.redis.aclose()


async def test_a_dp_rank_is_a_worker_given_the_group_stepper(bus_config: BusConfig, tiny_model: Path) -> None:
    worker = dp_worker(bus_config, tiny_model)
    try:
        assert isinstance(worker.stepper, DpStepper) and worker.stepper.table is worker.requests
        assert worker.stepper.plan() == StepPlan(0, False, False, 0.0)
        queue(worker, "r-a", batch="b1", entry="1-0")
        queue(worker, "r-b", batch="b2", entry="2-0")
        plan = worker.stepper.plan()
        assert (plan.prefill, plan.decode, plan.batch_id, plan.batch_ranks) == (True, False, "b1", 2)
        assert plan.held_batches == ("b1", "b2")
    finally:
        await worker.redis.aclose()


async def test_a_dp_ranks_plan_names_the_prefill_it_runs_next_by_priority(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    worker = dp_worker(bus_config, tiny_model)
    try:
        older = queue(worker, "r-low", batch="b1", entry="1-0", priority=2)
        urgent = queue(worker, "r-high", batch="b2", entry="2-0", priority=0)
        now = time.monotonic()
        older.queued_at, urgent.queued_at = now - 3600, now - 60  # the older one waited an hour
        plan = worker.stepper.plan()
        assert (plan.batch_id, plan.held_batches) == ("b2", ("b1", "b2"))
        assert 60_000 <= plan.waited_ms < 3_600_000  # r-high's wait, the batch it aligns
    finally:
        await worker.redis.aclose()


async def test_work_reaching_an_idle_group_wakes_the_other_ranks(bus_config: BusConfig, tiny_model: Path) -> None:
    worker = dp_worker(bus_config, tiny_model)
    stepper, stream = worker.stepper, bus_config.keys.dp("g0")
    assert isinstance(stepper, DpStepper)
    try:
        await stepper.work_arrived()  # the group is not idle: nobody to wake
        assert await worker.redis.xlen(stream) == 0 and worker.wake.is_set()
        stepper.group_idle = True
        await stepper.work_arrived()
        [(_, fields)] = await replies.entries(worker.redis, stream)
        assert fields[b"wake"] == b"0" and not stepper.group_idle
    finally:
        await worker.redis.aclose()


async def test_a_broken_group_fails_what_the_rank_holds_and_stops_it_with_its_exit_code(
    bus_config: BusConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = dp_worker(bus_config, tiny_model)
    stepper = worker.stepper
    assert isinstance(stepper, DpStepper)

    async def broken(*args: object) -> list[StepPlan]:
        raise GroupBroken("DP group g0 is broken: rank(s) [1] did not reach step 0", [1])

    monkeypatch.setattr(stepper.barrier, "exchange", broken)
    try:
        await worker.registry.register(worker.record(), lease_ms=5000)
        queue(worker, "r-held")
        await stepper.step()  # contained by the stepper: the loop it runs in sees a stop, not an error
        assert worker.loops.stopped and worker.exit_code == EXIT_GROUP_BROKEN
        assert worker.requests.of() == []
        (last,) = await entries(worker, "r-held")
        assert isinstance(last, Failed) and last.code == "dp_group_broken" and "rank(s) [1]" in last.message
        assert await Registry(worker.redis, bus_config).snapshot() == []  # it left the registry
    finally:
        await worker.redis.aclose()


async def test_a_rank_leaving_its_broken_group_stops_its_loops_first_and_leaves_no_record(
    bus_config: BusConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The break is handled in the engine loop's step, while the other loops run: they must stop
    # before the rank fails what it holds. A task the feed took after that would be queued with
    # nobody to fail it (the reaper never looks at a deregistered worker), and a heartbeat or a
    # give-back after the deregister would write the worker's record again.
    worker = dp_worker(bus_config, tiny_model)
    stepper, stream = worker.stepper, bus_config.keys.tasks("m0")
    assert isinstance(stepper, DpStepper)

    async def broken(*args: object) -> list[StepPlan]:
        raise GroupBroken("DP group g0 is broken: rank(s) [1] did not reach step 0", [1])

    async def task_comes_during_the_sweep(reason: str, missing: list[int]) -> None:
        request = GenerateRequest("r-late", "tiny", [97, 98], SamplingParams(max_tokens=4), "api", 0)
        await replies.add(worker.redis, stream, Task("mixed", request))
        for _ in range(40):  # a live task feed takes it at once; give it the chance
            if (await worker.redis.xpending(stream, WORKER_GROUP))["pending"]:
                break
            await asyncio.sleep(0.05)

    async def no_group_to_form() -> None:
        pass

    monkeypatch.setattr(stepper, "start", no_group_to_form)
    monkeypatch.setattr(stepper.barrier, "exchange", broken)
    monkeypatch.setattr(stepper, "fail_orphaned_tasks", task_comes_during_the_sweep)
    try:
        await worker.start()  # every background loop runs: the feed, the heartbeat, the publisher
        await stepper.step()
        assert worker.requests.of() == [] and (await worker.redis.xpending(stream, WORKER_GROUP))["pending"] == 0
        assert await worker.redis.exists(bus_config.keys.worker("m0"), bus_config.keys.lease("m0")) == 0
        assert worker.exit_code == EXIT_GROUP_BROKEN and worker.loops.pending() == []  # nothing writes after it
    finally:
        await worker.close()


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_prefill_or_decode_rank_leaving_its_broken_group_hands_what_it_holds_to_the_reaper(
    bus_config: BusConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, role: str
) -> None:
    # Issue 20: the requests of a broken prefill or decode group move to another group (the
    # reaper's exact continuation) instead of failing: the rank fails nothing, and its record
    # stays without a lease, for a reaper to take as dead (a deregistered one it never looks at).
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(
        bus=bus_config,
        role=role,
        model_dir=tiny_model,
        model_name="tiny",
        worker_id="w0",
        dp_group="g0",
        dp_rank=0,
        dp_size=2,
    )
    worker = Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 64, 16), DpStepper)
    stepper = worker.stepper
    assert isinstance(stepper, DpStepper)

    async def broken(*args: object) -> list[StepPlan]:
        raise GroupBroken("DP group g0 is broken: rank(s) [1] did not reach step 0", [1])

    async def swept(*args: object) -> None:
        raise AssertionError("a prefill or decode rank sweeps no stream: the reaper moves the missing rank's tasks")

    monkeypatch.setattr(stepper.barrier, "exchange", broken)
    monkeypatch.setattr(stepper, "fail_orphaned_tasks", swept)
    try:
        await worker.registry.register(worker.record(), lease_ms=5000)
        queue(worker, "r-held")
        await stepper.step()
        assert worker.loops.stopped and worker.exit_code == EXIT_GROUP_BROKEN
        assert await entries(worker, "r-held") == []  # not failed: it moves
        (info,) = await Registry(worker.redis, bus_config).snapshot()
        assert info.record.worker_id == "w0" and not info.alive  # in the live set, lease given up: reaped
    finally:
        await worker.redis.aclose()


async def test_a_bug_in_a_background_loop_stops_the_worker_non_zero(
    bus_config: BusConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = mixed_worker(bus_config, tiny_model)

    async def buggy() -> None:
        raise RuntimeError("a bug in the cancel loop")

    monkeypatch.setattr(worker.cancellation, "listen", buggy)
    await asyncio.wait_for(worker.run(), 10)  # ends by itself, closed
    assert worker.exit_code == 1 and worker.stopping.is_set()


async def test_a_sim_group_step_lasts_its_slowest_ranks_compute_plus_the_all_to_all_of_its_largest(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    costs = SimConfig(prefill_s_per_token=1e-4, decode_step_s=0.006, a2a_s=0.002, a2a_s_per_token=1e-5)
    first, second = ranks = [ep_rank(bus_config, tiny_model, r, costs) for r in (0, 1)]
    steppers = [w.stepper for w in ranks if isinstance(w.stepper, DpStepper)]
    assert len(steppers) == 2
    try:
        queue(first, "r-long", prompt=300)
        await asyncio.gather(*(s.step() for s in steppers))  # rank 0 prefills 300 tokens, rank 1 idles
        step = costs.forward_s("prefill", 300) + costs.a2a_s + 300 * costs.a2a_s_per_token
        assert [s.step_s for s in steppers] == [pytest.approx(step)] * 2
        assert second.steps.counters["idle_forwards"] == 1 and first.requests.count(Status.RUNNING) == 1

        queue(second, "r-short", prompt=40, entry="2-0")
        await asyncio.gather(*(s.step() for s in steppers))  # rank 0 decodes its 1 sequence, rank 1 prefills 40
        # The slowest compute is rank 0's decode (6.1 ms > 4 ms); the all-to-all is sized by rank 1's 40 tokens.
        step = costs.forward_s("decode", 1) + costs.a2a_s + 40 * costs.a2a_s_per_token
        assert costs.forward_s("decode", 1) > costs.forward_s("prefill", 40)
        assert [s.step_s for s in steppers] == [pytest.approx(step)] * 2
    finally:
        for worker in ranks:
            await worker.redis.aclose()
