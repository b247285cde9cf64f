"""`splitbus bench serve|scheduler|api` run end to end on small settings and write the documented
JSON (vLLM's field names for serve) and a PNG. They check the output's shape and what every
request got, never timings."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from splitbus.bench import scheduler as scheduler_bench
from splitbus.bench.serve_trace import RequestResult, ServeConfig, make_trace, summarize
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect

VLLM_FIELDS = (
    "completed",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
)
PNG = b"\x89PNG\r\n\x1a\n"


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", "bench", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = args[0]
    assert (out / f"bench_{name}.png").read_bytes()[:8] == PNG
    return json.loads((out / f"bench_{name}.json").read_text())


def test_serve_compares_the_stack_with_the_engine_driven_directly(tmp_path: Path) -> None:
    report = _bench(
        tmp_path,
        "serve",
        "--num-prompts",
        "12",
        "--request-rate",
        "20",
        "inf",
        "--input-len",
        "32",
        "--output-len",
        "8",
    )
    assert [(r["path"], r["request_rate"]) for r in report["runs"]] == [
        ("direct", 20.0),
        ("splitbus", 20.0),
        ("direct", "inf"),
        ("splitbus", "inf"),
    ]
    for run in report["runs"]:
        assert run["completed"] == 12 and run["failed"] == 0, run.get("errors")
        assert all(field in run for field in VLLM_FIELDS)
        assert 0 < run["median_ttft_ms"] <= run["p99_ttft_ms"] <= run["p99_e2el_ms"]
        _check_redis_memory(run, 12, measured=run["path"] == "splitbus")
    assert [o["request_rate"] for o in report["overhead"]] == [20.0, "inf"]
    floor = report["http_floor_ttft_ms"]  # the client and one HTTP server, nothing behind it
    assert 0 < floor["p50"] <= floor["p90"] < report["hops_ms"]["TTFT"]["p90"]
    steps = {line["mark"]: line for line in report["hop_steps_us"]}  # each hop to the microsecond
    assert {"api.total", "scheduler.total", "worker.total", "reader.total", "ttft"} <= set(steps)
    assert all(0 < steps[mark]["p50_us"] <= steps[mark]["p90_us"] for mark in ("api.route", "worker.prefilled"))


def _check_redis_memory(run: dict[str, Any], requests: int, measured: bool) -> None:
    """Redis's used_memory at the start and end of the run, and per request (None: no Redis)."""
    start, end = run["redis_used_memory_start_bytes"], run["redis_used_memory_end_bytes"]
    if not measured:
        assert (start, end, run["redis_memory_per_request_bytes"]) == (None, None, None)
        return
    assert isinstance(start, int) and isinstance(end, int) and start > 0 and end > 0
    assert run["redis_memory_per_request_bytes"] == pytest.approx((end - start) / requests)


def test_serve_measures_a_running_deployment(tmp_path: Path) -> None:
    from tests.e2e.conftest import start_system, stop_system

    system = start_system(tmp_path / "up")
    try:
        report = _bench(
            tmp_path,
            "serve",
            "--base-url",
            system.base_url,
            "--num-prompts",
            "6",
            "--request-rate",
            "inf",
            "--output-len",
            "5",
            "--data-dir",  # its embedded Redis's admin, who may read INFO memory
            str(tmp_path / "up"),
        )
        wrong_model = _bench_fails(tmp_path, "serve", "--base-url", system.base_url, "--model", "nope")
    finally:
        assert stop_system(system) == []
    (run,) = report["runs"]
    assert run["path"] == "http" and run["completed"] == 6 and "overhead" not in report
    _check_redis_memory(run, 6, measured=True)
    assert "does not serve model 'nope' (it serves ['tiny']); pass --model" in wrong_model


def _trace_file(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_serve_replays_a_trace_on_each_policy_with_the_ideal_hit_ratio(tmp_path: Path) -> None:
    """Two requests sharing their first 512-token block, on one fresh `up` per --policy."""
    trace = _trace_file(
        tmp_path,
        '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}',
        '{"timestamp": 50, "input_length": 520, "output_length": 2, "hash_ids": [7, 9]}',
    )
    report = _bench(
        tmp_path, "serve", "--dataset", "trace", trace, "--policy", "mixed", "--up-arg=--mixed=1",
        "--goodput", "e2el:600000",
    )  # fmt: skip
    (run,) = report["runs"]
    assert (run["path"], run["request_rate"], run["completed"], run["failed"]) == ("splitbus:mixed", "trace", 2, 0)
    assert run["total_input_tokens"] == 1120 and run["total_output_tokens"] == 5
    assert run["ideal_prefix_hit_ratio"] == 512 / 1120 and 0 <= run["prefix_hit_ratio"] <= 1
    assert run["request_goodput"] == run["request_throughput"]  # a bound every request meets
    assert report["config"]["policies"] == ["mixed"] and "overhead" not in report


def test_serve_names_a_bad_trace_line_before_starting_anything(tmp_path: Path) -> None:
    trace = _trace_file(tmp_path, '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "{oops")
    out = _bench_fails(tmp_path, "serve", "--dataset", "trace", trace)
    assert f"splitbus bench serve: {trace}:2: not JSON" in out
    assert not (tmp_path / "out").exists()
    assert "--policy nope: a policy is one of" in _bench_fails(tmp_path, "serve", "--policy", "nope")


def test_serve_says_when_the_deployment_is_unreachable(tmp_path: Path) -> None:
    out = _bench_fails(tmp_path, "serve", "--base-url", "http://127.0.0.1:1")
    assert "splitbus bench serve: cannot reach http://127.0.0.1:1" in out
    assert not (tmp_path / "out").exists()  # no report of a run that never happened


def _bench_fails(tmp_path: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", "bench", *args, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stdout


def test_scheduler_bench_places_every_request(tmp_path: Path, redis_server: Any) -> None:
    report = _bench(
        tmp_path,
        "scheduler",
        "--redis-url",
        redis_server.url,
        "--workers",
        "8",
        "--replicas",
        "1",
        "--api-dispatchers",
        "2",
        "--rate",
        "100",
        "--paced-requests",
        "60",
        "--flood-requests",
        "300",
        "--decisions",
        "400",
    )
    assert [(r["dispatch"], r["replicas"]) for r in report["results"]] == [("scheduler", 1), ("api", 2)]
    (decisions,) = report["decisions"]  # the policy alone, as columns and as rows: the same choices
    assert decisions["workers"] == 8 and decisions["same_choices"] is True
    assert all(0 < decisions[placer]["p50_us"] <= decisions[placer]["p99_us"] for placer in ("columns", "rows"))
    for r in report["results"]:
        assert r["paced"]["placed"] == 60 and r["flood"]["placed"] == 300
        assert 0 < r["paced"]["p50_ms"] <= r["paced"]["p99_ms"] and r["flood"]["decisions_per_s"] > 0


def test_api_bench_counts_tokens_and_connections(tmp_path: Path, redis_server: Any) -> None:
    # CLIENT LIST counts the connections: an admin command, beyond the splitbus user
    report = _bench(
        tmp_path,
        "api",
        "--redis-url",
        redis_server.admin_url,
        "--streams",
        "40",
        "--tokens",
        "12",
        "--client-processes",
        "2",
    )
    (run,) = report["runs"]  # one API process, the default
    assert run["completed"] == 40 and run["tokens"] == 40 * 12 and not run["errors"]
    assert 1 <= run["api_redis_connections_peak"] <= 8


def test_the_trace_is_seeded_and_lengths_stay_in_range() -> None:
    config = ServeConfig(num_prompts=50, input_len=100, output_len=20, len_range=0.5, seed=7)
    trace = make_trace(config, 10.0)
    assert trace == make_trace(config, 10.0)
    assert all(50 <= len(t.prompt_token_ids) <= 150 and 10 <= t.max_tokens <= 30 for t in trace)
    assert trace[0].arrival_s == 0.0 and all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(trace))
    assert all(t.arrival_s == 0.0 for t in make_trace(config, float("inf")))


def test_summary_uses_vllm_names_and_counts_failures() -> None:
    ok = RequestResult(True, prompt_tokens=10, output_tokens=3, ttft_s=0.010, itl_s=[0.002, 0.004], e2el_s=0.016)
    failed = RequestResult(False, prompt_tokens=10, error="HTTP 503")
    summary = summarize([ok, failed], duration_s=2.0)
    assert summary["completed"] == 1 and summary["failed"] == 1 and summary["errors"] == ["HTTP 503"]
    assert summary["output_throughput"] == 1.5 and summary["request_throughput"] == 0.5
    assert summary["median_ttft_ms"] == pytest.approx(10.0) and summary["mean_itl_ms"] == pytest.approx(3.0)
    assert summary["mean_tpot_ms"] == pytest.approx(3.0) and summary["p99_e2el_ms"] == pytest.approx(16.0)


@pytest.mark.parametrize("bench", ["scheduler", "api"])
def test_an_unreachable_redis_is_a_clear_error(tmp_path: Path, bench: str) -> None:
    out = _bench_fails(tmp_path, bench, "--redis-url", "redis://127.0.0.1:1/0")
    assert "splitbus bench: cannot reach Redis at redis://127.0.0.1:1/0" in out


async def test_scheduler_bench_reports_a_stall_instead_of_hanging(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler_bench, "_placing_s", lambda requests: 0.3)
    bus = BusConfig(redis_url=redis_server.url, prefix=f"stall{uuid.uuid4().hex[:6]}")
    redis = connect(bus)
    try:
        workers = scheduler_bench.FakeWorkers(redis, bus, 2)  # and no scheduler to place on them
        with pytest.raises(scheduler_bench.SchedulerStalled, match="none of 5 flood requests was placed"):
            await scheduler_bench._flood(
                redis, bus, workers, scheduler_bench.SchedulerBenchConfig(workers=(2,), flood_requests=5)
            )
    finally:
        await redis.aclose()


def test_stagger_bench_refuses_bad_options_and_empty_traces(tmp_path: Path) -> None:
    assert "--duration and --process-duration must be positive" in _bench_fails(
        tmp_path, "stagger", "--process-duration", "0"
    )
    assert "--process-ranks >= 0" in _bench_fails(tmp_path, "stagger", "--process-ranks", "-2")
    assert "--process-repeats must be >= 1" in _bench_fails(tmp_path, "stagger", "--process-repeats", "0")
    out = _bench_fails(tmp_path, "stagger", "--process-ranks", "0", "--sim-ranks", "1", "--duration", "0.001")
    assert "trace drew no requests in 0.001 s" in out and "Traceback" not in out
    assert not (tmp_path / "out" / "bench_stagger.json").exists()


def test_the_memory_row_says_the_difference_is_what_is_still_held() -> None:
    """(end - start) / requests is what Redis still holds at the end (streams in their grace, marks
    in their window), not what each request leaves for good: the row says so."""
    from splitbus.bench.report import _redis_memory_row

    run = {
        "redis_used_memory_start_bytes": 2**20,
        "redis_used_memory_end_bytes": 3 * 2**20,
        "redis_memory_per_request_bytes": 349.5,
    }
    row = _redis_memory_row(run)
    assert "1.0 MiB at the start, 3.0 MiB at the end, +350 B per request still held at the end" in row
