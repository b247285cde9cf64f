"""A rank of an expert-parallel decode group killed (SIGKILL) or hung (SIGSTOP, then SIGCONT)
while the group decodes, under `splitbus up --engine paddle --ep`: the other rank, waiting inside
a MoE layer's exchange, is not hung — its collective raises (a dead peer) or its forward runs past
``--ep-timeout`` (a hung one) — the group breaks, its ranks hand over and are restarted, the group
re-forms (a new process group for a new epoch), and every greedy stream completes exactly as one
model holding every expert computes it: no admitted request lost, the migrated ones continued
exactly. The decode group is the only one of its role, so its requests wait for it to re-form."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Awaitable, Callable, Iterator

import openai
import pytest

from splitbus.gpu_ops import device

device.prepare()

from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from tests.e2e import greedy  # noqa: E402
from tests.e2e.conftest import System, start_system, stop_system  # noqa: E402

NEW = 96
"""Tokens per stream: decoding lasts long enough for the signal to land mid-stream."""
EP_TIMEOUT_S = 2.0
PROMPTS = greedy.prompts(21, (3, 11, 19, 27))
STOP_S = 8.0
"""Longer than ``EP_TIMEOUT_S`` and the 3 s lease."""
BARRIER_TIMEOUT_S = 3.0
BROKEN = r"^d0-r0 (?!exited).*DP group d0 is broken: (.*)$"
IN_A_STEP = (
    "an engine step of a batch",  # killed: the collective raised (a dead peer)
    "an idle forward failed",  # killed while this rank had nothing to do
    f"did not finish within {EP_TIMEOUT_S:g}s",  # hung: the forward's bound
    f"within {BARRIER_TIMEOUT_S:g}s",  # either, landed between two steps: the barrier's bound
)
"""Where a signal lands is a matter of timing: mostly inside a forward (its exchanges), else at
the step barrier; the exchange's own failures are shown deterministically in
tests/gpu_ops/test_expert_parallel.py and tests/worker/test_dp_ep.py."""


@pytest.fixture(scope="module")
def ep_system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[System, list[str]]]:
    """One `up` (a prefill and a decode group of 2 ranks with --ep) for both tests, and the
    reference texts. Each test ends once the decode group has re-formed."""
    root = tmp_path_factory.mktemp("ep")
    model_dir = make_tiny_model(root / "tiny", "mixtral", seed=6, hidden=64, layers=2)
    reference = greedy.reference(model_dir, PROMPTS, NEW)
    args = ("--engine", "paddle", "--model", str(model_dir), "--prefill-dp", "2", "--decode-dp", "2", "--ep")
    # The moved requests wait for the only decode group to re-form (paddle's import, the group's
    # forming: 5-10 s on two shared cores), past the default 10 s wait for a worker.
    waits = (
        f"--worker-arg=--ep-timeout={EP_TIMEOUT_S}",
        "--scheduler-arg=--no-worker-wait=40",
        "--scheduler-arg=--dispatched-mark-ttl=120",
    )
    system = start_system(root / "up", *args, *waits)
    for group in ("p0", "d0"):  # `up` is ready before its groups have formed
        for rank in (0, 1):
            system.wait_output(rf"^{group}-r{rank} .*rank {rank} of 2 in step with the others", 60)
    yield system, reference
    stop_system(system)


DECODING = 8
"""Chunks every stream has received before the signal: both decode ranks are decoding."""


class Streams:
    """The greedy streams of ``PROMPTS``; ``decoding`` is set once each has ``DECODING`` chunks."""

    def __init__(self, system: System) -> None:
        self.system, self.decoding, self.chunks = system, asyncio.Event(), [0] * len(PROMPTS)

    async def texts_with(self, signal_rank: Callable[[], Awaitable[object]]) -> list[str]:
        # A hang guard, generous: after a stop the woken rank leaves only once its lease's rejoin
        # has waited for its reaper (10 s), and both ranks restart and re-form on busy cores.
        client = openai.AsyncOpenAI(base_url=self.system.v1, api_key="x", max_retries=0, timeout=150)
        try:
            texts = asyncio.gather(*(self.one(client, i) for i in range(len(PROMPTS))))
            await signal_rank()
            return list(await texts)
        finally:
            await client.close()

    async def one(self, client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=NEW, temperature=0, stream=True
        )
        text = []
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            self.chunks[i] += 1
            if min(self.chunks) >= DECODING:
                self.decoding.set()
        return "".join(text)

    async def signal_d0_r1(self, then: signal.Signals) -> int:
        """Once every stream is decoding, signal d0-r1; its pid."""
        await self.decoding.wait()
        pid = self.system.pid_of(r"--dp-group d0 --dp-rank 1")
        os.kill(pid, then)
        return pid


def _wait_reformed(system: System, since: int) -> None:
    for rank in (0, 1):
        system.wait_output(rf"^d0-r{rank} .*rank {rank} of 2 in step with the others", 60, start=since)


@pytest.mark.timeout(240)
def test_a_decode_rank_killed_inside_the_exchange_breaks_the_group_which_reforms_exactly(
    ep_system: tuple[System, list[str]],
) -> None:
    system, reference = ep_system
    since = len(system.output)
    streams = Streams(system)
    texts = asyncio.run(streams.texts_with(lambda: streams.signal_d0_r1(signal.SIGKILL)))
    assert all(reference) and len(set(reference)) > 1  # four different texts to compare
    assert texts == reference  # none lost, every one exact, continued after the group re-formed
    broken = system.wait_output(BROKEN, 10, start=since)
    assert any(why in broken.group(1) for why in IN_A_STEP), broken.group(0)
    _wait_reformed(system, since)


@pytest.mark.timeout(240)
def test_a_decode_rank_hung_inside_the_exchange_times_the_others_out_within_the_bound(
    ep_system: tuple[System, list[str]],
) -> None:
    system, reference = ep_system
    since = len(system.output)

    async def hang() -> None:
        pid = await streams.signal_d0_r1(signal.SIGSTOP)
        await asyncio.sleep(STOP_S)
        # Broken while d0-r1 is still stopped: d0-r0 was not hung by it.
        broken = re.search(BROKEN, "".join(system.output[since:]), re.M)
        assert broken and any(why in broken.group(1) for why in IN_A_STEP), "".join(system.output[since:])
        os.kill(pid, signal.SIGCONT)

    streams = Streams(system)
    texts = asyncio.run(streams.texts_with(hang))
    assert texts == reference
    _wait_reformed(system, since)
