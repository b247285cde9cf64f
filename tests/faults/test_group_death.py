"""kill -9 a rank of a prefill or a decode DP group while streams run through it, under
`splitbus up` with two groups of each role: the group breaks, its surviving rank hands what it
holds over (its lease given up, its tasks left to the reaper), the dead rank's tasks move once its
lease lapses, every stream still completes exactly (sim engine, the official openai client), and
the group re-forms: both its ranks are live in the registry again, in step with each other."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system
from tests.faults.kills import streams_with_a_kill

GROUPS = ("--prefill", "2", "--prefill-dp", "2", "--decode", "2", "--decode-dp", "2")
SLOW = ("--worker-arg=--sim-prefill-us-per-token=2000", "--worker-arg=--sim-decode-step-ms=25")
"""2 ms per prompt token: a rank's batch of 100-token prompts takes about a second; 25 ms per
decode step: 80 tokens take about 2 s."""


_streams = functools.partial(streams_with_a_kill, first_seed=700, timeout_s=30)


@pytest.fixture(scope="module")
def two_groups_each(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    """One `up` with two groups of each role for the two tests that kill a rank of one and move its
    work to the other (a CI-time cut: one start of ten processes, not two). Each test ends once its
    group has re-formed, both ranks live and in step, so the other finds the system whole, in
    either order; each reads `up`'s output from where it began."""
    system = start_system(tmp_path_factory.mktemp("up"), *GROUPS, *SLOW)
    yield system
    stop_system(system)


def _moved(system: System, since: int) -> int:
    """Tasks the reaper moved, from the scheduler's log (one line per dead worker it took)."""
    return sum(int(n) for n in re.findall(r"is dead: moved (\d+) task", "".join(system.output[since:])))


def _live_ranks(system: System, group: str) -> list[str]:
    """The ranks of ``group`` live in the registry (leased), by rank."""
    r = system.redis()
    ranks = []
    for worker in cast(list[str], r.zrange(Keys().workers, 0, -1)):
        record = cast(dict[str, str], r.hgetall(Keys().worker(worker)))
        if record.get("dp_group") == group and r.exists(Keys().lease(worker)):
            ranks.append(record["dp_rank"])
    return sorted(ranks)


def _assert_reformed(system: System, group: str, since: int) -> None:
    """Both ranks were restarted and stepped together again, and are live."""
    system.wait_output(rf"^{group}-r0 .*rank 0 of 2 in step with the others", 30, start=since)
    system.wait_output(rf"^{group}-r1 .*rank 1 of 2 in step with the others", 30, start=since)
    deadline = time.monotonic() + 10
    while _live_ranks(system, group) != ["0", "1"]:
        assert time.monotonic() < deadline, f"{group} did not re-form: live ranks {_live_ranks(system, group)}"
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_a_prefill_rank_killed_mid_prefill_moves_its_groups_prefills_to_the_other_group(
    two_groups_each: System,
) -> None:
    system = two_groups_each  # the kill lands 0.4 s into the prefills of 100-token prompts
    since = len(system.output)
    texts = asyncio.run(_streams(system, 12, 16, 100, r"--dp-group p0 --dp-rank 1", after_s=0.4))
    assert texts == [sim_text(700 + i, 16) for i in range(12)]  # none lost, every one exact
    system.wait_output(r"^p0-r0 .*DP group p0 is broken", 5, start=since)
    _assert_reformed(system, "p0", since)


@pytest.mark.timeout(120)
def test_a_decode_rank_killed_mid_stream_migrates_its_groups_streams_exactly(two_groups_each: System) -> None:
    system = two_groups_each  # 80 tokens take about 2 s, and the kill lands 1 s in
    since = len(system.output)
    texts = asyncio.run(_streams(system, 16, 80, 8, r"--dp-group d0 --dp-rank 1", after_s=1.0, logprobs=1))
    assert texts == [sim_text(700 + i, 80) for i in range(16)]  # migrated mid-stream: no gap, no duplicate
    assert _moved(system, since) > 0
    system.wait_output(r"^d0-r0 .*DP group d0 is broken", 5, start=since)
    _assert_reformed(system, "d0", since)


@pytest.mark.timeout(120)
def test_with_no_other_prefill_group_a_broken_groups_prefills_wait_for_it_to_re_form(tmp_path: Path) -> None:
    args = ("--prefill", "1", "--prefill-dp", "2", "--decode", "1", "--decode-dp", "2")
    system = start_system(tmp_path, *args, "--worker-arg=--sim-prefill-us-per-token", "--worker-arg=2000")
    try:
        since = len(system.output)
        texts = asyncio.run(_streams(system, 8, 16, 100, r"--dp-group p0 --dp-rank 1", after_s=0.3))
        assert texts == [sim_text(700 + i, 16) for i in range(8)]  # they waited, then ran on the re-formed p0
        system.wait_output(r"task\(s\) wait for the next pass \(for its DP group to re-form", 5, start=since)
        _assert_reformed(system, "p0", since)
    finally:
        stop_system(system)
