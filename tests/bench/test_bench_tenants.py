"""`splitbus bench tenants`: its pure parts (the seeded trace, how a request is classified, the
share of a's limit, the targets) and one short run through the CLI on real processes, checked by
counts, not timings: every request of every run ends (none lost), a is refused with 429 at its
limit and admitted within its bucket's allowance across the two API nodes, the steady tenants
are never refused, and without limits nothing is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from splitbus.bench.tenants import (
    RUNS,
    Item,
    Outcome,
    Sent,
    TenantsBenchConfig,
    limit_share,
    make_trace,
    one_bucket,
    refused_or_failed,
    targets,
    tenant_summary,
)

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_tenant_sends_the_same_requests_in_every_run() -> None:
    config = TenantsBenchConfig(duration_s=5)
    together, alone = make_trace(config, ("a", "b", "c")), make_trace(config, ("b",))
    assert [i for i in together if i.tenant == "b"] == alone  # the same arrivals and prompts
    assert [i.arrival_s for i in together] == sorted(i.arrival_s for i in together)
    assert all(0 < i.arrival_s < 5 and len(i.prompt_token_ids) == config.prompt_tokens for i in together)
    counts = {t: sum(i.tenant == t for i in together) for t in "abc"}
    assert counts["a"] > 10 * counts["b"]  # 5x capacity against 0.3x: a Poisson count, not exact
    assert make_trace(TenantsBenchConfig(duration_s=5, seed=1), ("b",)) != alone


@pytest.mark.parametrize(
    "change",
    [
        {"duration_s": 0},
        {"flood": float("nan")},
        {"prompt_tokens": 0},
        {"output_tokens": 2000},
        {"steady": 0.5, "a_rps": 0.1},  # more than the capacity before a's flood
        {"queued_prefill_tokens": -1},
    ],
)
def test_a_config_out_of_bounds_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TenantsBenchConfig(**change)


def test_statuses_before_the_first_byte_are_refusals_others_failures() -> None:
    limited = refused_or_failed(Sent("a", 0, 0.0, status=429), b'{"error": {"code": "rate_limit_exceeded"}}')
    assert (limited.outcome, limited.code) == (Outcome.REFUSED, "rate_limit_exceeded")
    overloaded = refused_or_failed(Sent("a", 1, 0.0, status=503), b'{"error": {"code": "overloaded"}}')
    assert (overloaded.outcome, overloaded.code) == (Outcome.REFUSED, "overloaded")
    late = refused_or_failed(Sent("a", 0, 0.0, status=504), b"not json")
    assert (late.outcome, late.code) == (Outcome.FAILED, "504")
    gone = refused_or_failed(Sent("a", 0, 0.0, status=503), b'{"error": {"code": "no_worker"}}')
    assert (gone.outcome, gone.code) == (Outcome.FAILED, "no_worker")  # the scheduler's, after admission


def test_a_tenant_summary_counts_outcomes_and_nodes() -> None:
    sent = [
        Sent("a", 0, 0.0, Outcome.COMPLETED, 200, ttft_s=0.1, output_tokens=4),
        Sent("a", 1, 0.1, Outcome.COMPLETED, 200, ttft_s=0.3, output_tokens=4),
        Sent("a", 0, 0.2, Outcome.REFUSED, 429, "rate_limit_exceeded"),
        Sent("a", 1, 0.3, Outcome.REFUSED, 503, "overloaded"),
        Sent("a", 1, 0.4, Outcome.FAILED, 504, "504"),
        Sent("a", 0, 0.5, Outcome.UNSENT, 0, "ConnectError"),
    ]
    s = tenant_summary(sent, duration_s=2.0)
    assert (s["sent"], s["completed"], s["refused"], s["failed"], s["lost"], s["admitted"]) == (6, 2, 2, 1, 0, 3)
    assert s["unsent"] == 1
    assert (s["refused_429"], s["refused_503"], s["admitted_by_node"]) == (1, 1, [1, 2])
    assert s["by_code"] == {
        "failed:504": 1,
        "refused:overloaded": 1,
        "refused:rate_limit_exceeded": 1,
        "unsent:ConnectError": 1,
    }
    assert s["ttft_p50_ms"] == pytest.approx(200) and s["output_tokens_per_s"] == 4.0
    assert tenant_summary([], 1.0)["ttft_p99_ms"] is None


def test_one_bucket_admits_a_burst_of_its_size_then_its_rate() -> None:
    assert one_bucket([0.0] * 4, 3.0) == 3  # a full bucket: one second of requests at once
    assert one_bucket([0.0] * 4, 0.5) == 1  # at least one request
    steady = [i / 10 for i in range(100)]  # 10 req/s for 10 s against 2 req/s
    assert one_bucket(steady, 2.0) == 2 + 19  # the burst, then one every 0.5 s after 0.5 s
    assert one_bucket([0.0, 5.0, 10.0], 0.2) == 3  # a full bucket again after 5 s


def test_a_limit_share_is_admitted_over_one_exact_bucket() -> None:
    config = TenantsBenchConfig(prompt_tokens=250, prefill_us_per_token=400, a_rps=0.2)  # 10 req/s: a's rps 2
    trace = [Item("a", i / 10, [1]) for i in range(100)] + [Item("b", 2.0, [1])]
    share = limit_share(config, sorted(trace, key=lambda i: i.arrival_s), {"admitted": 20})
    assert (share["rps_limit"], share["one_bucket"]) == (2.0, 21)
    assert share["allowed"] == pytest.approx(2 + 2 * 9.9)  # the bucket's second, then 9.9 s at 2 req/s
    assert share["ratio"] == pytest.approx(20 / 21)


def _runs(b_alone: float, b_on: float, lost: int = 0, a_failed: int = 0) -> dict[str, Any]:
    def tenant(p99: float, refused: int = 0, failed: int = 0, lost: int = 0) -> dict[str, Any]:
        return {"ttft_p99_ms": p99, "refused": refused, "failed": failed, "lost": lost}

    return {
        "b_alone": {"tenants": {"b": tenant(b_alone)}},
        "c_alone": {"tenants": {"c": tenant(100)}},
        "b_and_c": {"tenants": {"b": tenant(250), "c": tenant(100)}},
        "limits_on": {"tenants": {"a": tenant(300, 50, a_failed), "b": tenant(b_on), "c": tenant(110, lost=lost)}},
        "limits_off": {"tenants": {"a": tenant(9000, 0, 90), "b": tenant(5000), "c": tenant(5000)}},
    }


def test_targets_say_what_was_met() -> None:
    met = targets(_runs(200, 290), {"ratio": 1.02})
    assert met["b_ttft_p99_ratio"] == {"measured": 1.45, "bound": 1.5, "met": True}
    assert met["c_ttft_p99_ratio"]["met"] and met["c_ttft_p99_ratio"]["measured"] == pytest.approx(1.1)
    assert met["a_refused_early"]["met"] and met["zero_lost"]["met"] and met["limit_across_two_nodes"]["met"]
    assert met["ttft_p99_over_no_flood"] == {"b": pytest.approx(290 / 250), "c": pytest.approx(1.1)}
    missed = targets(_runs(200, 310, lost=1, a_failed=2), {"ratio": 0.94})
    assert not missed["b_ttft_p99_ratio"]["met"] and not missed["a_refused_early"]["met"]
    assert missed["zero_lost"] == {"lost_by_run": {**dict.fromkeys(RUNS, 0), "limits_on": 1}, "met": False}
    assert not missed["limit_across_two_nodes"]["met"]


def test_tenants_bench_runs_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitbus.cli.main",
            "bench",
            "tenants",
            "--duration",
            "1.5",
            "--request-timeout",
            "3",
            "--flood",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_tenants.json").read_text())
    assert (out / "bench_tenants.png").read_bytes().startswith(PNG)
    runs = report["runs"]
    assert list(runs) == list(RUNS)
    for run in runs.values():
        for s in run["tenants"].values():
            assert s["lost"] == s["unsent"] == 0 and s["sent"] == s["completed"] + s["refused"] + s["failed"]
    on, off = runs["limits_on"]["tenants"], runs["limits_off"]["tenants"]
    assert on["a"]["refused_429"] > 0 and on["a"]["by_code"].get("refused:rate_limit_exceeded", 0) > 0
    assert on["b"]["refused"] == on["c"]["refused"] == 0
    assert sum(s["refused"] for s in off.values()) == 0  # no limit, no early refusal
    share = report["a_limit_share"]
    assert share["admitted"] <= share["allowed"] + 1  # two nodes never admit past the shared bucket
    assert "targets:" in proc.stdout and "held by two API nodes together" in proc.stdout
