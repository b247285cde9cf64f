"""A DP rank with expert parallelism (``--ep``), against a real Redis: every forward is a
collective, so a forward that hangs (a rank stopped inside an exchange) is bounded by
``--ep-timeout``, one that raises (a dead peer) breaks the group instead of being run again per
request, and a rank whose prefill finds nothing to run still runs a forward. The engine stands in
for the paddle engine's collectives (their own failures: tests/gpu_ops/test_expert_parallel.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.dp import DpStepper, GroupBroken, StepPlan
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.sequence import Sequence
from splitbus.worker.worker import Worker
from tests.worker.test_stepper import queue

EP_TIMEOUT_S = 0.3


class Exchanging(SimEngine):
    """A sim engine whose forwards behave as a rank's collectives would when a peer hangs
    (``hang``) or died (``fail``)."""

    hang = False
    fail: type[Exception] | None = None

    async def forward(self) -> None:
        if self.fail:
            raise self.fail("Connection reset by peer")
        if self.hang:
            await asyncio.Event().wait()

    async def decode(self, batch: list[Sequence]) -> list[int]:
        await self.forward()
        return await super().decode(batch)

    async def idle(self) -> None:
        await self.forward()
        await super().idle()


def ep_rank(bus_config: BusConfig, tiny_model: Path) -> tuple[Worker, DpStepper, Exchanging]:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(
        bus=bus_config, role="mixed", model_dir=tiny_model, model_name="tiny", engine="paddle", worker_id="ep0",
        dp_group="g-ep", dp_rank=0, dp_size=2, ep=True, ep_timeout_s=EP_TIMEOUT_S,
    )  # fmt: skip
    engine = Exchanging(SimConfig(), tokenizer, 64, 16)
    worker = Worker(config, tokenizer, engine, DpStepper)
    assert isinstance(worker.stepper, DpStepper)
    return worker, worker.stepper, engine


async def test_a_forward_hung_in_an_exchange_breaks_the_group_after_the_ep_timeout(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    _, stepper, engine = ep_rank(bus_config, tiny_model)
    engine.hang = True
    with pytest.raises(GroupBroken, match=f"did not finish within {EP_TIMEOUT_S:g}s"):
        await asyncio.wait_for(stepper.act("idle"), 10)  # not hung: bounded by --ep-timeout


async def test_a_failed_collective_breaks_the_group_and_is_not_run_again_per_request(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    worker, stepper, engine = ep_rank(bus_config, tiny_model)
    for i in range(2):
        queue(worker, f"r{i}", entry=f"{i + 1}-0")
    await stepper.act("prefill")
    engine.fail = RuntimeError
    decodes = 0
    counted = engine.decode

    async def counting(batch: list[Sequence]) -> list[int]:
        nonlocal decodes
        decodes += 1
        return await counted(batch)

    engine.decode = counting  # type: ignore[method-assign]
    with pytest.raises(GroupBroken, match="an engine step of a batch of 2 failed: Connection reset by peer"):
        await stepper.act("decode")
    assert decodes == 1  # a dense rank would run each request alone; the other ranks would not join
    assert all(seq.finish_reason is None for seq in worker.requests.of())  # nothing failed here: handed over


async def test_a_rank_with_nothing_to_prefill_still_runs_a_forward(bus_config: BusConfig, tiny_model: Path) -> None:
    _, stepper, _ = ep_rank(bus_config, tiny_model)
    idle = stepper.steps.counters["idle_forwards"]
    await stepper.act("prefill")  # its plan said prefill; the queue holds nothing it can run
    await stepper.act("decode")
    assert stepper.steps.counters["idle_forwards"] == idle + 2


@pytest.mark.parametrize("error", [RuntimeError, ConnectionResetError, OSError])
async def test_an_idle_forward_whose_collective_fails_breaks_the_group(
    bus_config: BusConfig, tiny_model: Path, error: type[Exception]
) -> None:
    """A rank with nothing to do when a peer dies: its idle forward's exchange raises, and the
    group breaks (it used to escape the stepper and crash the rank, bypassing the hand-over)."""
    _, stepper, engine = ep_rank(bus_config, tiny_model)
    engine.fail = error
    with pytest.raises(GroupBroken, match="an idle forward failed: Connection reset by peer"):
        await stepper.act("idle")


async def test_a_collective_raising_an_os_error_breaks_the_group_not_a_redis_wait(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    """NCCL reports a failed collective as an OSError, which the worker's loops take for Redis
    being away (they wait and step again, alone): under EP an engine error breaks the group."""
    worker, stepper, engine = ep_rank(bus_config, tiny_model)
    queue(worker, "r0")
    await stepper.act("prefill")
    engine.fail = OSError
    with pytest.raises(GroupBroken, match="an engine step of a batch of 1 failed"):
        await stepper.act("decode")


def test_every_rank_times_and_announces_the_groups_largest_forward(bus_config: BusConfig, tiny_model: Path) -> None:
    """Under EP a rank's forward lasts the group's step: an idle rank learns and announces the
    largest prefill's time, not its own idle forward's (which waited for that prefill)."""
    _, stepper, _ = ep_rank(bus_config, tiny_model)
    long, short = StepPlan(1, True, False, 0.0, prefill_tokens=1000), StepPlan(0, False, False, 0.0)
    assert stepper.timed_forward([short, long], "idle", 0) == ("prefill", 1000)
    assert stepper.timed_forward([StepPlan(0, True, False, 0.0, prefill_tokens=64), long], "prefill", 64) == (
        "prefill",
        1000,
    )
    decoding = StepPlan(1, False, True, 0.0, decode_seqs=8)
    assert stepper.timed_forward([short, decoding], "idle", 0) == ("decode", 0)
    stepper.clock.observe(*stepper.timed_forward([short, long], "idle", 0), 0.5)
    assert stepper.clock.estimate("prefill", 100) == pytest.approx(0.05)  # 0.5 s for 1000 tokens
    assert stepper.clock.idle_s == 0.0  # nothing learned of an "idle forward" that waited 0.5 s
