"""`splitbus bench routing --quick` runs through the CLI and writes the documented JSON and a PNG.
It checks the shape of the output and that the counts add up, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_quick_routing_bench_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["bench", "routing", "--quick", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "bench_routing.json").read_text())
    assert report["machine"]["cpus"] and len(report["load_average"]["start"]) == len(report["load_average"]["end"]) == 3

    scoring = report["scoring"]
    assert scoring["chain_blocks"] == (16384 - 1) // 16  # the prompt less its last token
    assert scoring["depths"][0] == 0 and scoring["depths"][-1] == scoring["chain_blocks"]
    assert scoring["decision"]["overlap_blocks"] > 0
    for measure in ("hash", "overlaps", "place_sent", "place_fresh", "place_memoized"):
        r = scoring["results"][measure]
        assert r["n"] > 0 and 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"]
    assert isinstance(scoring["target_met"], bool)

    ingest = report["ingest"]
    for path in ("apply", "redis"):
        r = ingest["results"][path]
        assert r["batches"] > 0 and r["events"] == 2 * r["batches"] and r["hashes"] == 16 * r["batches"]
        assert r["events_per_s"] > 0
    assert ingest["results"]["redis"]["polls"] >= 1
    assert set(ingest["target_met"]) == {"apply", "redis"}

    recovery = report["recovery"]
    assert set(recovery["runs"]) == {"without_loss", "with_loss"}
    for run in recovery["runs"].values():
        assert run["series"] and 0 < run["hit_ratio"] <= 1
    (seed,) = recovery["seeds"]
    assert seed["resynced"] and seed["lost_batches"] > 0
    assert seed["index_statuses"]["gap"] == seed["index_statuses"]["resync"] == recovery["config"]["workers"]
    before = recovery["windows"]["before_loss"]
    assert before["without_loss"] == before["with_loss"]  # the same seed: identical until the loss
    assert recovery["windows"][recovery["target_window"]]["requests_with_loss"] > 0
    assert isinstance(recovery["target_met"], bool)

    assert (out / "bench_routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "target" in proc.stdout and "recovery" in proc.stdout
