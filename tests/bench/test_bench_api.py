"""``splitbus bench api --api-workers N ...``: a run per process count, each a row of the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from splitbus.bench.api_load import ApiBenchConfig, somaxconn
from splitbus.bench.report import api_table
from tests.bench.test_bench_serving import _bench, _bench_fails


def test_a_run_per_process_count_every_stream_whole(tmp_path: Path, redis_server: Any) -> None:
    report = _bench(
        tmp_path,
        "api",
        "--redis-url",
        redis_server.admin_url,  # CLIENT LIST and INFO: admin commands
        "--streams",
        "40",
        "--tokens",
        "12",
        "--api-workers",
        "1",
        "2",
    )
    assert [run["api_workers"] for run in report["runs"]] == [1, 2]
    for run in report["runs"]:
        assert run["completed"] == 40 and run["failed"] == run["resets"] == 0 and not run["errors"]
        assert run["tokens"] == 40 * 12 and run["redis_commands"] > 0
        # each process holds its own connections, within its own bound of 8
        assert run["api_workers"] <= run["api_redis_connections_peak"] <= 8 * run["api_workers"]
    assert report["somaxconn"] == somaxconn() and report["cpus"] >= 1
    table = api_table(report)
    assert table.splitlines()[2].split()[:3] == ["1", "40", "0"] and table.splitlines()[3].split()[:3] == [
        "2",
        "40",
        "0",
    ]


def test_process_counts_below_one_are_refused(tmp_path: Path) -> None:
    assert "api_workers" in _bench_fails(tmp_path, "api", "--api-workers", "2", "0")
    with pytest.raises(ValueError, match="api_workers"):
        ApiBenchConfig(api_workers=())
