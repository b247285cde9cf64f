"""bench serve's microsecond hop breakdown (splitbus/bench/hop_trace.py): reading the marks'
files and cutting a request's way into its steps (pure: the marks given here); the entries' stamps
against a real redis-server."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis

from splitbus.bench.hop_trace import (
    PATH,
    SKIPPED,
    TOKEN_PATH,
    TraceError,
    check,
    entry_stamps,
    hops_ms,
    main,
    markdown,
    missing,
    read_marks,
    steps_us,
    table,
    token_rows,
    token_table,
)
from splitbus.bench.http_client import HOPS
from splitbus.bus.core.keys import Keys


def test_marks_files_are_read_first_mark_of_a_name_wins_bad_lines_skipped(tmp_path: Path) -> None:
    (tmp_path / "1.marks").write_text("cmpl-a api.route 10\ncmpl-a api.read 50\ncut line\n")
    (tmp_path / "2.marks").write_text("cmpl-a api.read 70\ncmpl-b api.route x\ncmpl-a requests.read 30")
    (tmp_path / "other.txt").write_text("cmpl-c api.route 1\n")
    assert read_marks(tmp_path) == {"cmpl-a": {"api.route": 10, "api.read": 50, "requests.read": 30}}


def _stamps(step_us: float = 10.0) -> dict[str, int]:
    """A request that took every step of PATH, ``step_us`` each, from its send at 0."""
    stamps = {"client.sent": 0}
    stamps.update((step.mark, int((i + 1) * step_us * 1000)) for i, step in enumerate(PATH))
    return stamps


def test_each_step_counts_from_the_mark_before_it() -> None:
    stamps = {**_stamps(), "api.written": _stamps()["request.ts"] + 250_000}
    steps = steps_us(stamps)
    assert [steps[s.mark] for s in PATH] == [10.0] * len(PATH)
    assert steps["api.written"] == 250.0  # the side step: encoded -> the XADD's reply


def test_a_step_a_request_does_not_take_is_left_out() -> None:
    """--dispatch api: no request entry, no scheduler read; the task's ts counts from admission."""
    stamps = _stamps()
    for mark in ("request.ts", "requests.read", "requests.decoded"):
        del stamps[mark]
    steps = steps_us(stamps)
    assert "request.ts" not in steps and "requests.read" not in steps
    assert steps["task.ts"] == 40.0  # from api.admitted: the 4 steps it stands for
    assert sum(steps.values()) == pytest.approx(len(PATH) * 10.0)


def test_the_table_has_each_hop_s_total_and_the_ttft() -> None:
    rows = [steps_us(_stamps(10.0)), steps_us(_stamps(20.0)), steps_us(_stamps(30.0))]
    lines = {line["mark"]: line for line in table(rows)}
    assert lines["api.route"]["p50_us"] == 20.0 and lines["api.route"]["p90_us"] == pytest.approx(28.0)
    assert lines["scheduler.total"]["p50_us"] == 60.0  # three steps
    assert lines["ttft"]["p50_us"] == pytest.approx(20.0 * len(PATH))
    assert "api.written" not in lines  # no row has it
    assert lines["api.route"]["n"] == 3 and lines["ttft"]["n"] == 3
    assert "| reader | the reader hop | 3 | 100 | 140 |" in markdown(table(rows))


def test_a_step_some_rows_lack_counts_only_the_rows_that_have_it() -> None:
    partial = _stamps(30.0)
    del partial["api.body"]
    lines = {line["mark"]: line for line in table([steps_us(_stamps(10.0)), steps_us(partial)])}
    assert lines["api.body"]["n"] == 1 and lines["api.route"]["n"] == 2


def test_each_dispatch_mode_needs_every_mark_of_its_path() -> None:
    whole = _stamps()
    assert missing(whole, "scheduler") == [] and missing(whole, "api") == []
    api = {m: ns for m, ns in whole.items() if m not in SKIPPED["api"]}
    assert missing(api, "api") == []
    assert missing(api, "scheduler") == ["request.ts", "requests.read", "requests.decoded"]
    del api["worker.token"], api["client.sent"]
    assert missing(api, "api") == ["client.sent", "worker.token"]


def test_a_request_that_lacks_a_mark_fails_the_trace_by_name() -> None:
    """A missing mark would fold its step into the next one's time: the trace fails instead."""
    lacking = {**_stamps(), "id": "cmpl-b"}
    del lacking["worker.prefilled"]
    check([{**_stamps(), "id": "cmpl-a"}], "scheduler")  # nothing missing: no error
    with pytest.raises(
        TraceError, match=r"^1 of 2 requests lack marks \(scheduler dispatch\): cmpl-b: worker.prefilled$"
    ):
        check([{**_stamps(), "id": "cmpl-a"}, lacking], "scheduler")


def test_count_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--count", "0"])
    assert exited.value.code == 2 and "--count must be >= 1, got 0" in capsys.readouterr().err


async def test_entry_stamps_with_no_task_entry_fail_by_name(redis: aioredis.Redis) -> None:
    keys = Keys()
    with pytest.raises(TraceError, match="no task entry on the streams of 0 registered workers"):
        await entry_stamps(redis, keys)
    await redis.zadd(keys.workers, {"w1": 1})
    with pytest.raises(TraceError, match="no task entry on the streams of 1 registered workers"):
        await entry_stamps(redis, keys)


async def test_entry_stamps_leave_out_a_first_result_that_is_not_there(redis: aioredis.Redis) -> None:
    keys = Keys()
    await redis.zadd(keys.workers, {"w1": 1})
    request = {"request_id": "cmpl-x", "api_node": "api"}
    await redis.xadd(keys.tasks("w1"), {"data": orjson.dumps({"request": request}), "ts": 7})
    stamps = await entry_stamps(redis, keys)
    assert stamps == {"id": "cmpl-x", "task.ts": 7000}  # no request entry, no result yet
    whole = {**_stamps(), **stamps}
    del whole["token.ts"]
    assert missing(whole, "api") == ["token.ts"]  # which check names


def test_bench_serve_s_four_hops_come_from_the_same_probes() -> None:
    """client send, request/task/first token entries' ts, client's first token: 1, 2, 3, 4 ms."""
    ms = 1_000_000
    found = [{"client.sent": 0, "request.ts": ms, "task.ts": 3 * ms, "token.ts": 6 * ms, "client.first": 10 * ms}]
    hops = hops_ms(found)
    assert list(hops) == list(HOPS)
    assert [hops[name]["p50"] for name in HOPS] == [1.0, 2.0, 3.0, 4.0, 10.0]


def test_without_a_request_entry_the_scheduler_s_hop_is_zero() -> None:
    """--dispatch api: the first hop ends at the task's XADD."""
    ms = 1_000_000
    hops = hops_ms([{"client.sent": 0, "task.ts": 2 * ms, "token.ts": 5 * ms, "client.first": 6 * ms}])
    assert [hops[name]["p50"] for name in HOPS] == [2.0, 0.0, 3.0, 1.0, 6.0]


def test_a_steady_token_is_cut_from_the_step_before_it_to_the_client() -> None:
    """Token 2 of a stream: its step from token 1's end; the ITL from token 1's chunk; token 1 (the
    second, whose step starts at the prefill's hand-over) and a token without marks left out."""
    kept = {"cmpl-a/1": {"tok.step": 1_000_000}}
    kept["cmpl-a/2"] = {s.mark: 1_000_000 + (i + 1) * 10_000 for i, s in enumerate(TOKEN_PATH) if s.mark != "token.ts"}
    kept["cmpl-a/2"]["tok.written"] = kept["cmpl-a/2"]["tok.flush"] + 300_000
    found = [
        {
            "cmpl-a/1": {"token.ts": 900_000, "client.token": 1_500_000},
            "cmpl-a/2": {"token.ts": 1_045_000, "client.token": 5_600_000},
            "cmpl-a/3": {"token.ts": 1_200_000, "client.token": 9_000_000},
        }
    ]
    (row,) = token_rows(found, kept)
    assert row["tok.engine"] == 10.0 and row["tok.flush"] == 10.0 and row["token.ts"] == 5.0
    assert row["tok.read"] == 15.0  # from the entry's ts
    assert row["client.token"] == (5_600_000 - 1_090_000) / 1000  # from its event built
    assert row["tok.written"] == 295.0 and row["client.itl"] == 4100.0
    assert row["tok.cadence"] == (kept["cmpl-a/2"]["tok.step"] - 1_000_000) / 1000
    lines = {line["mark"]: line for line in token_table([row])}
    assert lines["step.total"]["p50_us"] == 30.0 and lines["worker.total"]["p50_us"] == 15.0


def test_no_steady_token_fails_the_token_trace() -> None:
    """Streams whose tokens did not pair with their chunks (or had no marks) give no row: the trace
    fails instead of printing a table of nothing."""
    assert token_rows([{}], {}) == []
    with pytest.raises(TraceError, match="no steady token has its marks"):
        token_table([])


def test_the_token_marks_do_not_count_in_a_request_s_required_marks(tmp_path: Path) -> None:
    """The per-token marks (kept under REQUEST/SEQ) stay out of the request's marks: its required
    marks' check sees only its own, whichever dispatch mode."""
    lines = [f"cmpl-a {mark} {ns}" for mark, ns in _stamps().items() if mark != "client.sent"]
    lines += ["cmpl-a/0 tok.step 5", "cmpl-a/1 tok.read 6", "cmpl-a/1 tok.sse 7"]
    (tmp_path / "1.marks").write_text("\n".join(lines) + "\n")
    kept = read_marks(tmp_path)
    assert set(kept) == {"cmpl-a", "cmpl-a/0", "cmpl-a/1"}
    assert not any(mark.startswith("tok.") for mark in kept["cmpl-a"])
    check([{**kept["cmpl-a"], "id": "cmpl-a", "client.sent": _stamps()["client.sent"]}], "scheduler")
