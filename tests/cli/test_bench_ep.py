"""`splitbus bench ep` from the command line: the simulation backend on a tiny config (no processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from splitbus.bench.ep import ROW_FIELDS

SPLITBUS = [sys.executable, "-m", "splitbus.cli.main", "bench", "ep"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SPLITBUS, *args], capture_output=True, text=True, timeout=120)


def test_the_simulation_backend_writes_json_png_and_a_table(tmp_path: Path) -> None:
    out = _run(
        "--backend",
        "simulation",
        "--sim-ranks",
        "2",
        "--loads",
        "moderate",
        "--duration",
        "0.5",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "simulation: 2+2 ranks, moderate load" in out.stdout  # progress
    report = json.loads((tmp_path / "bench_ep.json").read_text())
    assert [(r["backend"], r["ranks"], r["load"], r["mode"]) for r in report["results"]] == [
        ("simulation", 2, "moderate", "naive"),
        ("simulation", 2, "moderate", "staggered"),
    ]
    assert all(set(ROW_FIELDS) <= set(r) for r in report["results"])
    assert (tmp_path / "bench_ep.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_options_exit_2_naming_them(tmp_path: Path) -> None:
    out = _run("--backend", "simulation", "--runs", "0", "--out", str(tmp_path))
    assert out.returncode == 2
    assert "--runs must be >= 1" in out.stdout


def test_the_window_bound_is_an_option_recorded_in_the_json(tmp_path: Path) -> None:
    args = ("--backend", "simulation", "--sim-ranks", "2", "--loads", "low", "--duration", "0.5")
    args += ("--out", str(tmp_path))
    assert _run(*args).returncode == 0
    assert json.loads((tmp_path / "bench_ep.json").read_text())["stagger_max_wait_s"] == 0.5  # the scheduler's
    assert _run(*args, "--stagger-max-wait-ms", "50").returncode == 0
    assert json.loads((tmp_path / "bench_ep.json").read_text())["stagger_max_wait_s"] == 0.05
    out = _run(*args, "--stagger-max-wait-ms", "0")
    assert out.returncode == 2 and "--stagger-max-wait-ms must be positive" in out.stdout
