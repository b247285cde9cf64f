"""`splitbus bench grammar` runs through the CLI on the byte-level test tokenizer (the batch part on
random weights of the tiny test shape) and writes the documented JSON and a PNG. It checks the
shape of the output, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", "bench", "grammar", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_grammar_bench_writes_every_workload(tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "out"
    proc = _bench("--model", str(tiny_model), "--runs", "2", "--out", str(out), "--batches")  # no batch part
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "bench_grammar.json").read_text())
    assert "batch" not in report
    assert report["machine"]["cpus"] and report["runs"] == 2 and report["vocab_rows"] >= report["vocab_size"]
    assert set(report["workloads"]) == {"json_schema", "json_object", "regex"}
    for workload in report["workloads"].values():
        _check_workload(workload)
    assert isinstance(report["target_met"], bool)
    assert (out / "bench_grammar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "target <= 0.5 ms" in proc.stdout


def _check_workload(workload: dict[str, Any]) -> None:
    assert workload["tokens"] > 0 and workload["compile_ms"] > 0 and workload["build_ms"] > 0
    for part in ("mask_us", "apply_us", "advance_us", "total_us"):
        r = workload[part]
        assert 0 < r["p50"] <= r["p99"] <= r["max"] and r["mean"] > 0


def test_grammar_bench_sets_one_constrained_request_in_a_decode_batch(tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model), "--runs", "1", "--out", str(out)]
    proc = _bench(*argv, "--batches", "2", "3", "--batch-runs", "2", "--batch-steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    batch = json.loads((out / "bench_grammar.json").read_text())["batch"]
    assert batch["workload"] == "json_schema" and "random weights" in batch["model"]
    assert (batch["runs"], batch["steps"]) == (2, 2) and [r["batch"] for r in batch["results"]] == [2, 3]
    for row in batch["results"]:
        _check_batch_row(row, steps=4, runs=2)
    assert "(a) every request unconstrained, (b) one of them under json_schema's grammar" in proc.stdout
    assert (out / "bench_grammar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_batch_row(row: dict[str, Any], steps: int, runs: int) -> None:
    assert row["steps"] == steps and len(row["run_p50_ms"]) == runs and row["grammar_restarts"] >= 0
    for side in ("a_ms", "b_ms"):
        r = row[side]
        assert 0 < r["min"] <= r["p10"] <= r["p50"] <= r["p90"] <= r["max"]
    assert row["diff_ms"] == row["b_ms"]["p50"] - row["a_ms"]["p50"]
    assert row["diff_pct"] == row["diff_ms"] / row["a_ms"]["p50"] * 100
    paired = row["paired_diff_ms"]
    assert paired["p10"] <= paired["p50"] <= paired["p90"]
    assert row["within_spread"] == (row["a_ms"]["p10"] <= row["b_ms"]["p50"] <= row["a_ms"]["p90"])


def test_grammar_bench_refuses_a_folder_that_is_no_model(tmp_path: Path) -> None:
    proc = _bench("--model", str(tmp_path / "none"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "splitbus bench grammar:" in proc.stdout + proc.stderr


def test_grammar_bench_refuses_an_empty_batch_run(tmp_path: Path, tiny_model: Path) -> None:
    proc = _bench("--model", str(tiny_model), "--out", str(tmp_path / "out"), "--batch-runs", "0")
    assert proc.returncode == 2 and "batch runs and batch steps must be at least 1" in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()
