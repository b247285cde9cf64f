"""``splitbus api --workers N`` and ``splitbus up --api-workers N``: the flags, their default and its cap."""

from __future__ import annotations

import pytest

from splitbus.api.procs import MAX_DEFAULT_WORKERS
from splitbus.cli.main import build_parser
from splitbus.env import load_env
from tests.cli.test_up_groups import started


def _parsed(monkeypatch: pytest.MonkeyPatch, cpus: int | None, *argv: str) -> int:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(cpus or 0)))
    monkeypatch.setattr("splitbus.api.procs.cgroup_cpus", lambda: None)
    args = build_parser(load_env({})).parse_args(argv)
    return int(args.workers if args.command == "api" else args.api_workers)


@pytest.mark.parametrize("command", [("api", "--model", "m"), ("up",)])
def test_the_default_is_the_hosts_cores_capped(monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...]) -> None:
    assert _parsed(monkeypatch, 2, *command) == 2
    assert _parsed(monkeypatch, 1, *command) == 1
    assert _parsed(monkeypatch, 64, *command) == MAX_DEFAULT_WORKERS == 8
    assert _parsed(monkeypatch, None, *command) == 1  # cores unknown: one process


def test_the_flags_take_any_positive_count(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parsed(monkeypatch, 2, "api", "--model", "m", "--workers", "16") == 16
    assert _parsed(monkeypatch, 64, "up", "--api-workers", "1") == 1


@pytest.mark.parametrize("argv", [("api", "--model", "m", "--workers", "0"), ("up", "--api-workers", "-1")])
def test_a_count_below_one_is_a_usage_error(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        build_parser(load_env({})).parse_args(argv)
    assert ended.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_up_hands_the_count_to_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    api = started("--api-workers", "3")["api"][0]
    assert api[api.index("--workers") + 1] == "3"
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(64)))
    monkeypatch.setattr("splitbus.api.procs.cgroup_cpus", lambda: None)
    api = started()["api"][0]
    assert api[api.index("--workers") + 1] == str(MAX_DEFAULT_WORKERS)


@pytest.mark.parametrize("command", [("api", "--model", "m"), ("up",)])
def test_splitbus_api_workers_sets_the_default_and_the_flag_wins(command: tuple[str, ...]) -> None:
    flag = "--workers" if command[0] == "api" else "--api-workers"
    dest = flag.lstrip("-").replace("-", "_")
    env = load_env({"SPLITBUS_API_WORKERS": "3"})
    assert getattr(build_parser(env).parse_args(list(command)), dest) == 3
    assert getattr(build_parser(env).parse_args([*command, flag, "2"]), dest) == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_splitbus_api_workers_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match=f"^SPLITBUS_API_WORKERS must be a whole number of 1 or more: '{value}'$"):
        load_env({"SPLITBUS_API_WORKERS": value})
    assert load_env({"SPLITBUS_API_WORKERS": ""}).api_workers is None
