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
