"""docker-compose.yml and the Dockerfile: the file is valid (``docker-compose config``, which
parses it without an engine), and the commands it runs work, run here as processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from splitbus.redis_server import EmbeddedRedis, free_port
from splitbus.worker.sim import sim_text

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("api", "scheduler", "prefill", "decode")


def _compose_config(**variables: str) -> dict:
    if shutil.which("docker-compose") is None:
        if os.environ.get("SPLITBUS_REQUIRE_COMPOSE"):
            pytest.fail("docker-compose is not installed (.ci/run installs Debian's package)")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITBUS_")} | variables
    out = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_the_compose_file_is_valid_and_complete() -> None:
    config = _compose_config()
    services = config["services"]
    assert set(PARTS) | {"redis"} <= set(services)
    redis = services["redis"]
    assert redis["image"].startswith("redis:") and "--appendonly" in redis["command"]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    for name in ("redis", *PARTS):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    for name in PARTS:
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert services[name]["environment"]["SPLITBUS_REDIS_URL"] == "redis://redis:6379/0"
    assert services["prefill"]["command"][services["prefill"]["command"].index("--engine") + 1] == "paddle"


def test_environment_switches_engine_and_model() -> None:
    services = _compose_config(SPLITBUS_ENGINE="sim", SPLITBUS_MODEL="/models/qwen", SPLITBUS_MODELS_DIR="/srv/hf")["services"]
    for name in ("prefill", "decode"):
        command = services[name]["command"]
        assert command[command.index("--engine") + 1] == "sim"
        assert command[command.index("--model") + 1] == "/models/qwen"
        assert any(str(v).startswith("/srv/hf:/models") for v in services[name]["volumes"])
    assert services["api"]["command"][services["api"]["command"].index("--model") + 1] == "/models/qwen"


def test_the_dockerfile_is_slim_and_runs_as_a_user() -> None:
    lines = [line.split() for line in (ROOT / "Dockerfile").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0][0] == "FROM" and lines[0][1].endswith("-slim")
    user = [words[1] for words in lines if words[0] == "USER"]
    assert user and user[-1] != "root"
    assert ["ENTRYPOINT", '["splitbus"]'] in lines
    assert "tests" in (ROOT / ".dockerignore").read_text().split()


class Deployment:
    """The compose services' commands as local processes: service host names become loopback
    and every port a free one."""

    def __init__(self, services: dict, redis_url: str, prefix: str) -> None:
        self.ports = {name: {"8000": str(free_port()), "9100": str(free_port()), "7000": str(free_port())} for name in PARTS}
        self.env = {**os.environ, **services["api"]["environment"], "SPLITBUS_REDIS_URL": redis_url, "SPLITBUS_PREFIX": prefix}
        self.procs = {name: self._start(name, services[name]["command"]) for name in ("scheduler", "prefill", "decode", "api")}
        self.services = services

    def local(self, name: str, words: list[str]) -> list[str]:
        mapping = {"0.0.0.0": "127.0.0.1", "prefill": "127.0.0.1", "decode": "127.0.0.1", **self.ports[name]}
        return [self._rewrite(w, mapping) for w in words]

    @staticmethod
    def _rewrite(word: str, mapping: dict[str, str]) -> str:
        if word in mapping and word not in ("prefill", "decode"):
            return mapping[word]
        for port in ("8000", "9100"):
            word = word.replace(f"127.0.0.1:{port}", f"127.0.0.1:{mapping.get(port, port)}")
        return word

    def _start(self, name: str, command: list[str]) -> subprocess.Popen[str]:
        args = self.local(name, command)
        if "--transfer-advertise-host" in args:
            args[args.index("--transfer-advertise-host") + 1] = "127.0.0.1"
        return subprocess.Popen([sys.executable, "-m", "splitbus.cli.main", *args], env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)

    def healthy(self, name: str) -> bool:
        test = self.local(name, self.services[name]["healthcheck"]["test"][1:])
        assert test[0] == "python"
        return subprocess.run([sys.executable, *test[1:]], capture_output=True, timeout=10, check=False).returncode == 0

    def stop(self) -> dict[str, int | None]:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = None
        return codes


@pytest.fixture
def deployment(redis_server: EmbeddedRedis, tiny_model: Path) -> Iterator[Deployment]:
    services = _compose_config(SPLITBUS_ENGINE="sim", SPLITBUS_MODEL=str(tiny_model))["services"]
    running = Deployment(services, redis_server.url, f"d{uuid.uuid4().hex[:8]}")
    yield running
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal (exit status 143).
    assert running.stop() == {"scheduler": 0, "prefill": 0, "decode": 0, "api": -signal.SIGTERM}


def test_the_compose_commands_serve_a_request(deployment: Deployment) -> None:
    api = f"http://127.0.0.1:{deployment.ports['api']['8000']}"
    deadline = time.monotonic() + 90
    while not _ok(f"{api}/ready"):
        assert time.monotonic() < deadline, "the API did not become ready"
        assert all(p.poll() is None for p in deployment.procs.values()), "a part exited"
        time.sleep(0.2)
    for name in PARTS:
        assert deployment.healthy(name), f"{name}'s health check failed"
    client = openai.OpenAI(base_url=f"{api}/v1", api_key="x", max_retries=0, timeout=60)
    reply = client.completions.create(model="tiny", prompt="compose", max_tokens=6, seed=3)
    assert reply.choices[0].text == sim_text(3, 6)
    scheduler_metrics = urllib.request.urlopen(f"http://127.0.0.1:{deployment.ports['scheduler']['9100']}/metrics", timeout=5).read().decode()
    assert 'splitbus_scheduler_dispatches_total{outcome="dispatched"} 1.0' in scheduler_metrics


def _ok(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False
