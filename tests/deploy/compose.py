"""docker-compose.yml as docker-compose reads it (``docker-compose config``, which parses the file
without an engine), for the tests of what it deploys."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from splitbus.cli.main import build_parser
from splitbus.env import load_env

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {"SPLITBUS_API_KEYS": "compose-test-key-0123456789", "SPLITBUS_REDIS_PASSWORD": "compose-redis-pw-0123456789"}


def compose(*profiles: str, **variables: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("docker-compose") is None:
        if os.environ.get("SPLITBUS_REQUIRE_COMPOSE"):
            pytest.fail("docker-compose is not installed (.ci/run installs Debian's package)")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITBUS_")} | variables
    return subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), *(f"--profile={p}" for p in profiles), "config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
        check=False,
    )


def compose_config(*profiles: str, **variables: str) -> dict:
    out = compose(*profiles, **(SECRETS | variables))
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def host_ip(port: str | dict) -> str:
    """docker-compose 1.x prints ``IP:HOST:CONTAINER/tcp``, Compose v2 a mapping."""
    return port["host_ip"] if isinstance(port, dict) else port.rsplit(":", 2)[0]


def bind_mounts(service: dict) -> dict[str, Path]:
    """A service's bind mounts: path in the container -> path on the host (named volumes left out)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = (volume["source"], volume["target"]) if isinstance(volume, dict) else volume.split(":")[:2]
        if source.startswith(("/", ".")):
            mounts[target] = Path(source)
    return mounts


def parse_command(words: list[str]) -> argparse.Namespace:
    """``splitbus WORDS`` parsed by the real command line (argparse exits 2 on a bad one)."""
    return build_parser(load_env({})).parse_args([str(word) for word in words])
