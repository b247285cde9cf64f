"""What `splitbus up` hands the API it starts, and what `splitbus api` makes of it: no processes."""

from __future__ import annotations

from pathlib import Path

from splitbus.api.app import known_host_names
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
