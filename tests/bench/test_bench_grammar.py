"""`splitbus bench grammar` runs through the CLI on the byte-level test tokenizer and writes the
documented JSON and a PNG. It checks the shape of the output, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_grammar_bench_writes_every_workload(tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "out"
    argv = ["bench", "grammar", "--model", str(tiny_model), "--runs", "2", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "bench_grammar.json").read_text())
    assert report["machine"]["cpus"] and report["runs"] == 2 and report["vocab_rows"] >= report["vocab_size"]
    assert set(report["workloads"]) == {"json_schema", "json_object", "regex"}
    for workload in report["workloads"].values():
        assert workload["tokens"] > 0 and workload["compile_ms"] > 0 and workload["build_ms"] > 0
        for part in ("mask_us", "apply_us", "advance_us", "total_us"):
            r = workload[part]
            assert 0 < r["p50"] <= r["p99"] <= r["max"] and r["mean"] > 0
    assert isinstance(report["target_met"], bool)
    assert (out / "bench_grammar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "target <= 0.5 ms" in proc.stdout


def test_grammar_bench_refuses_a_folder_that_is_no_model(tmp_path: Path) -> None:
    argv = ["bench", "grammar", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "splitbus bench grammar:" in proc.stdout + proc.stderr
