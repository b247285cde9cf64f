"""bench serve's microsecond hop breakdown (splitbus/bench/hop_trace.py): reading the marks'
files and cutting a request's way into its steps (pure: the marks given here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.bench.hop_trace import PATH, markdown, read_marks, steps_us, table


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
    assert "| reader | the reader hop | 100 | 140 |" in markdown(table(rows))
