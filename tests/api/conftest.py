"""A live `splitbus api` process on loopback, a tiny model folder, and the scripted responder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.redis_server import EmbeddedRedis, free_port
from splitbus.tokenization import ModelTokenizer
from tests.api.responder import Responder

CONTEXT = 512


@dataclass
class ApiProcess:
    url: str
    node_id: str
    config: BusConfig
    proc: subprocess.Popen[bytes]
    log: Path | None = None
    """Its stderr, when the test keeps it (``start_api(stderr=...)``)."""

    @property
    def v1(self) -> str:
        return self.url + "/v1"


def start_api(redis_url: str, prefix: str, models: list[Path], *extra: str, stderr: Path | None = None) -> ApiProcess:
    """A live API process; its stderr goes to ``stderr`` when given (tests read it)."""
    port = free_port()
    node_id = f"api-{uuid.uuid4().hex[:6]}"
    args = [
        sys.executable,
        "-m",
        "splitbus.cli.main",
        "api",
        "--port",
        str(port),
        "--redis-url",
        redis_url,
        "--node-id",
        node_id,
        "--workers",  # one process: the tests read its node id, its log and its /metrics as the API's
        "1",
    ]
    for folder in models:
        args += ["--model", str(folder)]
    env = {**os.environ, "SPLITBUS_PREFIX": prefix}
    env.pop("SPLITBUS_API_KEYS", None)
    err = stderr.open("wb") if stderr is not None else subprocess.DEVNULL
    proc = subprocess.Popen(args + list(extra), env=env, stdout=subprocess.DEVNULL, stderr=err)
    api = ApiProcess(f"http://127.0.0.1:{port}", node_id, BusConfig(redis_url=redis_url, prefix=prefix), proc, stderr)
    _wait_healthy(api)
    return api


def _wait_healthy(api: ApiProcess, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if api.proc.poll() is not None:
            raise RuntimeError(f"splitbus api exited with {api.proc.returncode}")
        try:
            if httpx.get(api.url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("splitbus api did not become healthy")


def stop_api(api: ApiProcess) -> None:
    api.proc.terminate()
    try:
        api.proc.wait(10)
    except subprocess.TimeoutExpired:
        api.proc.kill()


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"api{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def responder(redis_server: EmbeddedRedis, tiny_model: Path, prefix: str) -> Iterator[Responder]:
    config = BusConfig(redis_url=redis_server.url, prefix=prefix)
    responder = Responder(config, ModelTokenizer.load(tiny_model, "tiny")).start()
    yield responder
    responder.stop()


@pytest.fixture(scope="module")
def api(
    redis_server: EmbeddedRedis,
    tiny_model: Path,
    prefix: str,
    responder: Responder,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ApiProcess]:
    log = tmp_path_factory.mktemp("api") / "stderr.log"
    yield from running_api(redis_server.url, prefix, [tiny_model], "--request-timeout", "5", stderr=log)


def running_api(
    redis_url: str, prefix: str, models: list[Path], *extra: str, stderr: Path | None = None
) -> Iterator[ApiProcess]:
    """A live API that sees a live worker, for a fixture to yield from: stopped after its tests."""
    api = start_api(redis_url, prefix, models, *extra, stderr=stderr)
    try:
        _wait_for_model(api)
        yield api
    finally:
        stop_api(api)


def _wait_for_model(api: ApiProcess, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(api.url + "/ready", timeout=2).status_code == 200:
            return
        time.sleep(0.05)
    raise RuntimeError("the API never saw a live worker")
