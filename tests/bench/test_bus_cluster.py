"""The pieces of `bench bus --redis-cluster` that need no servers: which API node follows which
streams, the hashed tags it compares with the placed ones (the API's own placement, tested in
tests/bus/core/test_cluster.py), the command counts' arithmetic, a run's check of what was read
against what was written, and how a run stops its processes (forked stand-ins here)."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from redis.crc import key_slot

from splitbus.bench import bus_cluster
from splitbus.bench.bus_cluster import ClusterBenchConfig, _run, _stop, api_names, assignment, delta, hashed_readers
from splitbus.redis_cluster import slot_ranges


def owner_of(primaries: int) -> Callable[[int], int]:
    ranges = slot_ranges(primaries)
    return lambda slot: next(i for i, (low, high) in enumerate(ranges) if low <= slot <= high)


def test_every_stream_goes_to_exactly_one_api_node() -> None:
    groups = assignment(ClusterBenchConfig(streams=10, api_nodes=3))
    assert [len(g) for g in groups] == [4, 3, 3]
    assert sorted(rid for g in groups for rid in g) == sorted(f"tok-{i}" for i in range(10))


def test_hashed_tags_are_the_plain_names() -> None:
    # Where these land is CRC16's choice: on 3 primaries, bench-api-1 and -2 share one.
    assert api_names(ClusterBenchConfig(api_nodes=2)) == ("bench-api-0", "bench-api-1")
    tags = hashed_readers(ClusterBenchConfig(api_nodes=3))
    assert tags == ("bench-api-0.0", "bench-api-1.0", "bench-api-2.0")
    assert [owner_of(3)(key_slot(t.encode())) for t in tags] == [1, 2, 2]


def test_delta_keeps_the_commands_that_ran() -> None:
    before = {"xadd": 10, "xread": 4, "auth": 1}
    after = {"xadd": 1010, "xread": 4, "auth": 2, "evalsha": 3}
    assert delta(before, after) == {"auth": 1, "evalsha": 3, "xadd": 1000}


def test_a_cluster_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match="between 2 and 16"):
        ClusterBenchConfig(primaries=1)
    with pytest.raises(ValueError, match="at most the number of streams"):
        ClusterBenchConfig(streams=2, api_nodes=3)


def test_a_run_whose_readers_missed_a_written_token_fails() -> None:
    """Engines say (first step's µs, tokens written), API nodes (tokens read, last read's µs)."""
    run = _run([(100, 6), (110, 6)], [(12, 2_100_000)], [], ("t",))
    assert (run.tokens, run.written, run.start_spread_us, run.seconds) == (12, 12, 10, 2.0999)
    with pytest.raises(RuntimeError, match="^the API nodes read 11 tokens, the engines wrote 12$"):
        _run([(100, 6), (110, 6)], [(11, 2_100_000)], [], ("t",))


@pytest.fixture
def default_sigterm() -> Iterator[None]:
    """Forked stand-ins inherit this process's SIGTERM handler: one an earlier test left installed
    (a Python handler that returns) would make ``time.sleep`` resume after a terminate."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)


def _deaf(ready: Any) -> None:
    """A process that ignores SIGTERM (one stuck where it cannot be interrupted)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(60)


@pytest.mark.usefixtures("default_sigterm")
def test_stop_terminates_every_process_then_kills_what_outlives_the_wait() -> None:
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    sleeping, deaf = ctx.Process(target=time.sleep, args=(60,)), ctx.Process(target=_deaf, args=(ready,))
    never = ctx.Process(target=time.sleep, args=(60,))  # not started: an earlier start failed
    sleeping.start()
    deaf.start()
    assert ready.wait(30)
    _stop([sleeping, deaf, never], timeout_s=0.5)
    assert (sleeping.exitcode, deaf.exitcode, never.exitcode) == (-signal.SIGTERM, -signal.SIGKILL, None)


@pytest.mark.usefixtures("default_sigterm")
def test_an_api_node_that_fails_to_start_stops_those_started_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fork, started = mp.get_context("fork"), []

    class Context:
        """Spawn's stand-in: its first process sleeps, its second fails to start."""

        Pipe = fork.Pipe

        def Barrier(self, parties: int) -> None:  # noqa: N802 (multiprocessing's name)
            return None

        def Process(self, target: Any, args: tuple[Any, ...]) -> mp.process.BaseProcess:  # noqa: N802
            if started:
                raise OSError("no more processes")
            started.append(fork.Process(target=time.sleep, args=(60,)))
            return started[0]

    monkeypatch.setattr(bus_cluster.mp, "get_context", lambda method: Context())
    setup = SimpleNamespace(url="redis://127.0.0.1:1", placed=True, primaries=[])
    with pytest.raises(OSError, match="no more processes"):
        bus_cluster.run_once(setup, "bench-x", ClusterBenchConfig(streams=4, api_nodes=2))  # type: ignore[arg-type]
    assert started[0].exitcode == -signal.SIGTERM  # stopped, not left running
