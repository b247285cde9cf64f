"""Prefill groups and decode groups (splitbus/worker/dp.py) against a real Redis: a prefill
group's ranks step together, each step a prefill or an idle forward; a decode group's too, a
rank whose KV has not come yet idling in the step, and the KV's arrival waking an idle group."""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task, TokenDelta
from splitbus.tokenization import ModelTokenizer
from splitbus.worker import dp
from splitbus.worker.config import WorkerConfig
from splitbus.worker.dp import DpStepper, StepPlan, bind_late
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.kv_proof import Header, kv_proof
from splitbus.worker.sequence import Sequence
from splitbus.worker.table import Status
from splitbus.worker.text import TextStream
from splitbus.worker.transfer import KV
from splitbus.worker.worker import Worker
from tests.worker import replies
from tests.worker.replies import add, decoded

BOUND_S = 5.0
"""Far beyond any step here: a rank that misses a post shows as a timeout, not a hang."""
PEER = "p0-r0"


def request(request_id: str, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(request_id, "tiny", [97, 98], SamplingParams(max_tokens=max_tokens), "api", 0)


def group(bus_config: BusConfig, tiny_model: Path, role: str, size: int = 2) -> list[Worker]:
    """The ranks of group ``{role[0]}0``, each with its barrier in one epoch (the group formed)."""
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    ranks = []
    for rank in range(size):
        config = WorkerConfig(
            bus=bus_config,
            role=role,
            model_dir=tiny_model,
            model_name="tiny",
            worker_id=f"{role[0]}0-r{rank}",
            dp_group=f"{role[0]}0",
            dp_rank=rank,
            dp_size=size,
        )
        worker = Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 64, 16), DpStepper)
        stepper(worker).barrier.begin(epoch_ms=1)
        ranks.append(worker)
    return ranks


def stepper(worker: Worker) -> DpStepper:
    assert isinstance(worker.stepper, DpStepper)
    return worker.stepper


async def step_together(ranks: list[Worker]) -> None:
    await asyncio.wait_for(asyncio.gather(*(stepper(w).step() for w in ranks)), BOUND_S)


def counted(worker: Worker) -> tuple[int, int]:
    """(steps, idle forwards) of the rank."""
    return worker.steps.counters["steps"], worker.steps.counters["idle_forwards"]


async def close(ranks: list[Worker]) -> None:
    for worker in ranks:
        await worker.loops.close()
        await worker.redis.aclose()


def queue_prefill(worker: Worker, request_id: str) -> Sequence:
    """A prefill task taken: its writer open, its blocks reserved, queued to prefill."""
    seq = Sequence(Task("prefill", request(request_id), peer="d0-r0"), "1-0", TextStream(worker.tokenizer, []))
    worker.writer.open(request_id, reader="api")
    assert worker.engine.reserve(seq, 16)
    worker.requests.add(seq, Status.QUEUED)
    return seq


async def take_decode_task(worker: Worker, request_id: str) -> Sequence:
    """A decode task from p0-r0 written to the rank's stream and taken: AWAITING_KV."""
    await worker.tasks.ensure_group()
    await add(worker.redis, worker.keys.tasks(worker.id), Task("decode", request(request_id), peer=PEER, handoff="h"))
    await worker.feed.feed_tasks()
    seq = worker.requests.get(request_id, Status.AWAITING_KV)
    assert seq is not None
    return seq


async def kv_comes(worker: Worker, seq: Sequence) -> None:
    """p0-r0's KV frame for ``seq`` reaches the rank over the transfer path's import: RUNNING."""
    assert isinstance(worker.engine, SimEngine)
    payload = worker.engine.kv_payload(seq.request)
    meta = {"output_token_ids": [5], "next_seq": 1}
    size, crc = len(payload), zlib.crc32(payload)
    proof = kv_proof(seq.kv_secret, PEER, seq.request_id, meta, size, crc)
    assert (
        await worker.receiver.import_kv(PEER, Header(KV, seq.request_id, {**meta, "proof": proof}, size, crc), payload)
        is None
    )
    assert worker.requests.status(seq) is Status.RUNNING


async def test_a_prefill_group_steps_together_one_rank_prefilling_the_other_idle(
    bus_config: BusConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy, idle = ranks = group(bus_config, tiny_model, "prefill")
    handed: list[str] = []

    async def hand_off(seq: Sequence) -> None:  # the hand-off itself is tested in test_handoff.py
        handed.append(seq.request_id)

    monkeypatch.setattr(busy.outbox, "ship", hand_off)
    seq = queue_prefill(busy, "r-p")
    try:
        await step_together(ranks)
        assert counted(busy) == (1, 0) and counted(idle) == (1, 1)  # one step each; the idle rank's forward counted
        assert busy.requests.status(seq) is Status.HANDING_OFF and busy.steps.counters["prefills_done"] == 1
        await asyncio.sleep(0)  # the spawned hand-off runs
        assert handed == ["r-p"]
        await busy.publisher.publish()
        assert [type(e) for e in await decoded(busy.redis, busy.keys.out("api", "r-p"))] == [
            TokenDelta
        ]  # the first token
        plans = [e for _, e in await replies.entries(busy.redis, bus_config.keys.dp("p0")) if b"plan" in e]
        assert sorted(StepPlan.from_json(e[b"plan"]).rank for e in plans) == [0, 1]  # both posted step 0
    finally:
        await close(ranks)


async def test_a_decode_rank_whose_kv_has_not_come_idles_in_the_step(bus_config: BusConfig, tiny_model: Path) -> None:
    waiting, running = ranks = group(bus_config, tiny_model, "decode")
    try:
        late = await take_decode_task(waiting, "r-late")
        await kv_comes(running, await take_decode_task(running, "r-here"))
        await step_together(ranks)
        assert counted(waiting) == (1, 1) and counted(running) == (1, 0)
        assert waiting.requests.status(late) is Status.AWAITING_KV
        await kv_comes(waiting, late)
        await step_together(ranks)
        assert counted(waiting) == (2, 1) and counted(running) == (2, 0)  # both decoded
        assert late.output_ids[0] == 5 and len(late.output_ids) == 2
    finally:
        await close(ranks)


async def test_the_kv_reaching_a_rank_of_an_idle_decode_group_wakes_the_group(
    bus_config: BusConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dp, "IDLE_WAIT_S", BOUND_S * 2)  # only a post to the group ends its idle wait here
    first, second = ranks = group(bus_config, tiny_model, "decode")
    stream = bus_config.keys.dp("d0")
    try:
        seq = await take_decode_task(first, "r-d")  # a decode task alone brings no work: no nudge
        idle = asyncio.ensure_future(step_together(ranks))
        for _ in range(100):
            if stepper(first).group_idle and stepper(second).group_idle:
                break
            await asyncio.sleep(0.02)
        assert stepper(first).group_idle and stepper(second).group_idle and not idle.done()
        assert not [e for _, e in await replies.entries(first.redis, stream) if b"wake" in e]
        await kv_comes(first, seq)
        await asyncio.wait_for(idle, BOUND_S)  # woken by the KV's arrival, not by the idle timeout
        assert [e[b"wake"] for _, e in await replies.entries(first.redis, stream) if b"wake" in e] == [b"0"]
        await step_together(ranks)
        assert counted(first) == (1, 0) and counted(second) == (1, 1)
    finally:
        await close(ranks)


def test_a_kv_that_came_after_the_plan_decodes_in_the_step() -> None:
    posted, current = StepPlan(0, False, False, 0.0), StepPlan(0, False, True, 0.0)
    plans = [posted, StepPlan(1, False, True, 0.0)]
    assert bind_late("idle", posted, current, plans, 20.0) == "decode"
    assert bind_late("none", posted, current, plans, 20.0) == "none"  # the group did not step: next time
    assert bind_late("decode", current, current, plans, 20.0) == "decode"
