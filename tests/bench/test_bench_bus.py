"""`splitbus bench bus --quick` runs and writes the documented JSON and a PNG.
It checks the shape of the output, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_quick_bus_bench_writes_json_and_png(tmp_path: Path, redis_server: object) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitbus.cli.main",
            "bench",
            "bus",
            "--quick",
            "--out",
            str(out),
            "--redis-url",
            redis_server.url,
        ],  # type: ignore[attr-defined]
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "bench_bus.json").read_text())
    for path in ("request_path", "token_path"):
        section = report[path]
        for transport in ("redis", "zeromq"):
            numbers = section[transport]
            assert numbers["msgs_per_s"] > 0
            assert 0 <= numbers["p50_us"] <= numbers["p99_us"]
        assert section["ratio"] == round(section["redis"]["msgs_per_s"] / section["zeromq"]["msgs_per_s"], 3)
    assert (out / "bench_bus.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ratio" in proc.stdout
    # The benchmark cleans up its keys in a Redis it did not start.
    import redis

    assert not list(redis.Redis.from_url(redis_server.url).scan_iter(match="bench-*"))  # type: ignore[attr-defined]


def test_quick_cluster_bench_reports_each_primarys_share(tmp_path: Path) -> None:
    """`bench bus --redis-cluster 3 --quick` on a few streams: one Redis and a 3+3 cluster it
    starts itself, the documented fields, shares that add up, the tags placed one per primary (by
    the API's own ``ResultReader``)."""
    out = tmp_path / "out"
    argv = ["bench", "bus", "--redis-cluster", "3", "--quick", "--streams", "6", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", *argv], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "bench_bus_cluster.json").read_text())
    assert report["target_busiest_share"] == round(1 / 3 + 0.1, 4)
    single, hashed, placed = report["setups"]
    assert [s["primaries"] for s in report["setups"]] == [1, 3, 3]
    for s in report["setups"]:
        assert s["tokens"] == 6 * 3  # every token of every stream arrived (3 steps in --quick)
        assert s["tokens_per_s"] > 0
        assert s["commands"] == sum(sum(calls.values()) for calls in s["commands_by_primary"])
        assert s["commands_per_token"] == round(s["commands"] / s["tokens"], 4)
        assert abs(sum(s["primary_shares"]) - 1) < 0.01
        assert s["busiest_share"] == max(s["primary_shares"])
        assert sum(calls.get("evalsha", 0) for calls in s["commands_by_primary"]) >= 3  # the engine's steps
    assert sorted(r["primary"] for r in placed["readers"]) == [0, 1, 2]  # the API's placement, one per primary
    assert all(sorted(run) == [0, 1, 2] for run in placed["runs_primaries"])
    assert [r["tag"] for r in hashed["readers"]] == ["bench-api-0.0", "bench-api-1.0", "bench-api-2.0"]
    assert single["primary_shares"] == [1.0]
    assert report["target_met"] == (placed["busiest_share"] <= report["target_busiest_share"])
    assert (out / "bench_bus_cluster.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "busiest primary" in proc.stdout


def test_cluster_bench_refuses_a_one_primary_cluster(tmp_path: Path) -> None:
    argv = ["bench", "bus", "--redis-cluster", "1", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "splitbus.cli.main", *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "between 2 and 16" in proc.stdout + proc.stderr
