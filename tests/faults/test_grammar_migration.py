"""kill -9 the decode worker of constrained requests mid-stream: the request moves, the worker that
takes it over rebuilds its grammar from the tokens streamed so far, and the grammar holds (sim
engine, so the expected text is known)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator

import pytest

from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system
from tests.faults.kills import moved_tasks, streams_with_a_kill

LETTERS = 80
GRAMMAR = {"guided_regex": f"[a-z ]{{{LETTERS}}}"}
"""The sim's own tokens are letters and spaces, so the grammar lets its text through unchanged and
ends it at exactly LETTERS tokens: a grammar rebuilt from nothing after the move would let it run
on to max_tokens, one that lost tokens would stop early."""


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("up"), "--decode", "2", "--worker-arg=--sim-decode-step-ms=25")
    yield running
    stop_system(running)


@pytest.mark.timeout(180)
def test_the_grammar_holds_through_a_migration(system: System) -> None:
    """80 tokens take ~2 s at 25 ms a step; the kill lands 1 s in, mid-stream."""
    since = len(system.output)
    streams = functools.partial(streams_with_a_kill, first_seed=700, extra_body=GRAMMAR)
    texts = asyncio.run(streams(system, 16, LETTERS + 40, 8, after_s=1.0, victim=r"--role decode"))
    assert texts == [sim_text(700 + i, LETTERS) for i in range(16)]
    assert moved_tasks(system, since) > 0  # the killed worker held some of them
