"""`bench bus --redis-cluster N --engines E`: E writer processes split the streams and start
together. Tiny runs against the session's real Redis and its loopback cluster check that every
token each writer wrote reached an API node and that the rows carry the writers; never timings."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from splitbus.bench.bus_cluster import (
    ClusterBenchConfig,
    Run,
    cluster_setups,
    run_once,
    single_setups,
    split,
    summarize,
)
from splitbus.redis_cluster import EmbeddedCluster
from splitbus.redis_server import EmbeddedRedis

TINY = ClusterBenchConfig(streams=12, steps=3, api_nodes=3, repeat=1, engines=2)


def test_each_stream_has_exactly_one_writer_and_each_writer_every_tag() -> None:
    streams = [(f"tok-{i}", f"tag-{i % 3}") for i in range(12)]
    shares = split(streams, 2)
    assert [len(s) for s in shares] == [6, 6]
    assert sorted(s for share in shares for s in share) == sorted(streams)
    assert all({tag for _, tag in share} == {"tag-0", "tag-1", "tag-2"} for share in shares)
    assert split(streams[:3], 1) == [streams[:3]]


@pytest.mark.parametrize(("engines", "streams"), [(0, 10), (17, 100), (5, 4)])
def test_engines_out_of_bounds_are_refused(engines: int, streams: int) -> None:
    with pytest.raises(ValueError, match="--engines must be between 1 and 16 and at most the number of streams"):
        ClusterBenchConfig(streams=streams, api_nodes=1, engines=engines)


def test_engines_default_to_one_writer() -> None:
    assert ClusterBenchConfig().engines == 1


def test_two_writers_on_one_redis_deliver_every_token(redis_server: EmbeddedRedis) -> None:
    with single_setups(redis_server, TINY) as setups:
        (setup,) = setups
        run = run_once(setup, f"bench-{uuid.uuid4().hex[:8]}", TINY)
    assert run.written == run.tokens == TINY.streams * TINY.steps
    assert run.start_spread_us >= 0 and run.seconds > 0
    row = summarize(setup, [run], TINY.engines)
    assert setup.name == "1 primary, 2 writers"
    assert (row["engines"], row["tokens"], row["written"]) == (2, 36, 36)
    assert row["start_spread_ms"] == round(run.start_spread_us / 1000, 3)
    evalsha = row["commands_by_primary"][0].get("evalsha", 0)
    assert evalsha >= TINY.engines * TINY.steps  # each writer's steps, one script per tag a writer writes


def test_two_writers_on_the_cluster_deliver_every_token(redis_cluster: EmbeddedCluster) -> None:
    hashed, placed = cluster_setups(redis_cluster, TINY)
    assert (hashed.name, placed.name) == ("3 primaries, hashed tags, 2 writers", "3 primaries, placed tags, 2 writers")
    run: Run = run_once(placed, f"bench-{uuid.uuid4().hex[:8]}", TINY)
    assert run.written == run.tokens == TINY.streams * TINY.steps
    row = summarize(placed, [run], TINY.engines)
    assert row["engines"] == 2
    assert sorted(r["primary"] for r in row["readers"]) == [0, 1, 2]  # the API's placement, one tag per primary
    # Both writers write to every tag: each primary runs a script per writer per step.
    assert all(calls.get("evalsha", 0) >= TINY.engines * TINY.steps for calls in row["commands_by_primary"])


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--redis-cluster", "3", "--engines", "0"], "--engines must be between 1 and 16"),
        (["--redis-cluster", "3", "--engines", "40"], "--engines must be between 1 and 16"),
        (["--engines", "2", "--quick"], "--engines needs --redis-cluster N"),
    ],
)
def test_the_cli_refuses_engines_it_cannot_run(argv: list[str], said: str, tmp_path: object) -> None:
    command = [sys.executable, "-m", "splitbus.cli.main", "bench", "bus", *argv, "--out", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert said in proc.stdout + proc.stderr
