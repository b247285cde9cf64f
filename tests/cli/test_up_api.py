"""What `splitbus up` hands the API it starts, and what `splitbus api` makes of it: no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.api.app import known_host_names
from splitbus.api.config import ApiConfig
from splitbus.bus.core.config import BusConfig
from splitbus.cli.api_cmd import build_config
from splitbus.cli.main import build_parser
from splitbus.env import load_env
from tests.cli.test_up_groups import started


def test_up_passes_allowed_hosts_to_the_api_only_when_given() -> None:
    api = started("--allowed-hosts", "api.internal,proxy.lan")["api"][0]
    assert api[api.index("--allowed-hosts") + 1] == "api.internal,proxy.lan"
    assert "--allowed-hosts" not in started()["api"][0]


def test_api_answers_to_its_host_and_the_allowed_names(tiny_model: Path, tmp_path: Path) -> None:
    def names(*argv: str) -> frozenset[str] | None:
        env = load_env({})
        args = build_parser(env).parse_args(["api", "--model", str(tiny_model), "--data-dir", str(tmp_path), *argv])
        return known_host_names(build_config(args, env))

    assert names("--host", "box.lan", "--allowed-hosts", " API.internal , proxy.lan.") == {
        "localhost",
        "box.lan",
        "api.internal",
        "proxy.lan",
    }
    assert names("--allowed-hosts", "*") is None  # any name
    assert names("--api-key", "k1") is None  # the key is the guard


def test_up_passes_the_tool_call_parser_to_the_api_and_the_api_takes_it(tiny_model: Path, tmp_path: Path) -> None:
    api = started("--tool-call-parser", "hermes")["api"][0]
    assert api[api.index("--tool-call-parser") + 1] == "hermes"
    assert "--tool-call-parser" not in started()["api"][0]
    env = load_env({})
    argv = ["api", "--model", str(tiny_model), "--data-dir", str(tmp_path)]
    assert build_config(
        build_parser(env).parse_args([*argv, "--tool-call-parser", "llama3_json"]), env
    ).tool_call_parser == ("llama3_json")
    assert build_config(build_parser(env).parse_args(argv), env).tool_call_parser is None


def test_up_passes_no_early_refusal_to_the_api_and_the_api_takes_it(tiny_model: Path, tmp_path: Path) -> None:
    api = started("--api-arg=--no-early-refusal")["api"][0]
    assert api[-1] == "--no-early-refusal"
    env = load_env({})
    argv = ["api", "--model", str(tiny_model), "--data-dir", str(tmp_path)]
    assert build_config(build_parser(env).parse_args([*argv, "--no-early-refusal"]), env).early_refusal is False
    assert build_config(build_parser(env).parse_args(argv), env).early_refusal is True


def test_an_unknown_tool_call_parser_is_refused_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser(load_env({})).parse_args(["up", "--tool-call-parser", "mistral"])
    assert "'hermes', 'llama3_json'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no tool-call parser is named 'mistral'"):
        ApiConfig(bus=BusConfig(), models=(), tool_call_parser="mistral")
