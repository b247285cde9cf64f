"""`splitbus bench choices` runs through the CLI on `up --engine paddle` with its tiny random model
(small settings) and writes the documented JSON and a PNG. It checks the output's shape and P's
prefill counts (counts, not timings): each response of (a), one request with n choices, computed
its prompt once; each of (b), n requests with n = 1, n times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

N, PAIRS = 3, 2
PNG = b"\x89PNG\r\n\x1a\n"


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", "bench", "choices", *argv],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_choices_bench_counts_one_prefill_for_n_choices(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--n", str(N), "--pairs", str(PAIRS), "--prompt-tokens", "32", "--max-tokens", "2", "--out", str(out)]
    proc = _bench(*argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_choices.json").read_text())
    _check_header(report)
    a, b = report["sides"]["a"], report["sides"]["b"]
    _check_side(a, computed=1, shared=N - 1, prompt_tokens=32)  # usage counts the prompt once
    _check_side(b, computed=N, shared=0, prompt_tokens=N * 32)
    assert a["prompts_computed_per_response"] == 1 and b["prompts_computed_per_response"] == N
    assert report["one_prefill_met"] is True
    assert report["wall_ratio_b_over_a"] == b["wall_ms"]["p50"] / a["wall_ms"]["p50"]
    paired = report["paired_diff_ms"]
    assert paired["p10"] <= paired["p50"] <= paired["p90"]
    assert (out / "bench_choices.png").read_bytes()[:8] == PNG
    assert f"(a) one request, n = {N}" in proc.stdout and "met" in proc.stdout


def _check_header(report: dict[str, Any]) -> None:
    config = {"n": N, "pairs": PAIRS, "prompt_tokens": 32, "max_tokens": 2, "seed": 0, "engine": "paddle"}
    assert report["config"] == config
    assert report["target"] == "splitbus up --engine paddle --prefill 1 --decode 1"
    assert report["model"] == "tiny (random weights)" and report["machine"]["cpus"]


def _check_side(side: dict[str, Any], computed: int, shared: int, prompt_tokens: int) -> None:
    assert [r["pair"] for r in side["responses"]] == list(range(PAIRS))
    assert side["prompts_computed_each"] == [computed] * PAIRS
    for row in side["responses"]:
        assert (row["prefills_done"], row["prefills_shared"], row["prompts_computed"]) == (N, shared, computed)
        assert row["prompt_tokens"] == prompt_tokens
        assert row["completion_tokens"] == N * 2  # EOS ignored: every choice makes its max_tokens
        assert row["prompt_tokens_computed"] == row["prompt_tokens"] - row["cached_tokens"] >= 0
        assert row["wall_ms"] > 0
    wall = side["wall_ms"]
    assert 0 < wall["min"] <= wall["p50"] <= wall["p90"] <= wall["max"]


def test_choices_bench_refuses_n_below_two(tmp_path: Path) -> None:
    proc = _bench("--n", "1", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "--n must be between 2 and 16" in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


def test_choices_bench_refuses_a_model_that_is_not_there(tmp_path: Path) -> None:
    proc = _bench("--model", str(tmp_path / "none"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "splitbus bench choices:" in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()
