"""``splitbus api --workers 2`` on loopback, with the scripted responder as scheduler and workers:
two processes on one port, each a node of its own (the requests name it), under a parent that
stops them together and fails when one of them ends; one scrape of /metrics counts both; a port
already held is refused before any process starts; a tenant's limit holds across them (its
bucket is in Redis)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from splitbus.api.procs import reuse_port_socket
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.tenants import Tenant, TenantLimits, TenantStore, key_digest
from splitbus.redis_server import EmbeddedRedis
from splitbus.tokenization import ModelTokenizer
from tests.api.conftest import ApiProcess, _wait_for_model, start_api, stop_api
from tests.api.responder import Responder, expected_text
from tests.e2e.conftest import _descendants, alive


def _two_processes(redis_server: EmbeddedRedis, tiny_model: Path, prefix: str) -> ApiProcess:
    """``splitbus api --workers 2``, once both processes hold their Redis connections and one
    answers /ready (the other's queue holds what reaches it until it serves)."""
    api = start_api(redis_server.url, prefix, [tiny_model], "--workers", "2")
    client = redis.Redis.from_url(redis_server.admin_url, decode_responses=True)
    deadline = time.monotonic() + 30
    nodes = {f"{api.node_id}-0", f"{api.node_id}-1"}
    while not nodes <= {c["name"] for c in client.client_list()}:
        assert time.monotonic() < deadline and api.proc.poll() is None, "both API processes never connected"
        time.sleep(0.05)
    client.close()
    _wait_for_model(api)
    return api


def _processes_of(api: ApiProcess) -> list[int]:
    """The API processes: the parent's children that run ``spawn_main`` (not multiprocessing's
    resource tracker; each API process's chat-template processes are its own children)."""
    return [
        pid
        for pid in _descendants(api.proc.pid)
        if _parent(pid) == api.proc.pid and "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
    ]


def _outlived(pids: list[int], wait_s: float = 10.0) -> list[int]:
    """Those of ``pids`` still alive after up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_requests_spread_over_both_processes_stream_whole_and_are_counted_in_one_scrape(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder
) -> None:
    api = _two_processes(redis_server, tiny_model, prefix)
    try:
        want, _ = expected_text(24)
        for _ in range(30):  # each on a connection of its own: the kernel spreads them by address
            with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as http:
                client = openai.OpenAI(base_url=api.v1, api_key="x", max_retries=0, http_client=http)
                stream = client.completions.create(model="tiny", prompt="hello", max_tokens=24, stream=True)
                assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want
        served = {r.api_node for r in responder.requests if r.api_node.startswith(api.node_id)}
        assert served == {f"{api.node_id}-0", f"{api.node_id}-1"}
        for _ in range(6):  # each scrape on a connection of its own, served by either process: the same sum
            assert _sample(api, "splitbus_api_requests_total", route="/v1/completions", status="200") == 30
            assert _sample(api, "splitbus_api_inflight_requests") == 0
    finally:
        stop_api(api)


def _sample(api: ApiProcess, name: str, **labels: str) -> float:
    """The value of ``name``'s sample with ``labels`` in one scrape of the API's /metrics."""
    text = httpx.get(api.url + "/metrics", headers={"connection": "close"}, timeout=10).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_sigterm_to_the_parent_stops_every_process(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder
) -> None:
    api = _two_processes(redis_server, tiny_model, prefix)
    children, everything = _processes_of(api), _descendants(api.proc.pid)
    assert len(children) == 2
    api.proc.send_signal(signal.SIGTERM)
    assert api.proc.wait(30) == 0
    assert not any(alive(pid) for pid in children)
    assert _outlived(everything) == []  # their own children too (chat-template processes, the tracker)


def test_a_stream_that_never_ends_does_not_hold_the_stop_past_the_grace(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder, tmp_path: Path
) -> None:
    """uvicorn would wait for it forever: the bounded grace cuts it, and each process stops by
    itself, before the parent's kill."""
    err = tmp_path / "api.err"
    api = start_api(redis_server.url, prefix, [tiny_model], "--workers", "2", stderr=err)
    _wait_for_model(api)
    before = len(responder.served)
    body = {"model": "tiny", "prompt": "[silent]", "max_tokens": 3, "stream": True}
    ended: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", api.v1 + "/completions", json=body, timeout=120) as response:
                response.read()
            ended.append("closed")
        except httpx.HTTPError as exc:
            ended.append(type(exc).__name__)

    client = threading.Thread(target=stream)
    client.start()
    deadline = time.monotonic() + 30
    while len(responder.served) == before:  # the request is on the bus: its stream is open
        assert time.monotonic() < deadline, "the request never reached the responder"
        time.sleep(0.05)
    api.proc.send_signal(signal.SIGTERM)
    assert api.proc.wait(60) == 0
    client.join(60)
    assert ended and "did not stop within" not in err.read_text()


def test_a_killed_process_stops_the_others_and_the_parent_fails(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder
) -> None:
    api = _two_processes(redis_server, tiny_model, prefix)
    try:
        children, everything = _processes_of(api), _descendants(api.proc.pid)
        os.kill(children[0], signal.SIGKILL)
        assert api.proc.wait(30) == 1
        assert not any(alive(pid) for pid in children)
        assert _outlived(everything) == []
    finally:
        if api.proc.poll() is None:
            api.proc.kill()


def _plain_listener() -> socket.socket:
    """A port held without SO_REUSEPORT."""
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    return plain


def _another_group() -> socket.socket:
    """A port held by another group of API processes (SO_REUSEPORT: this group's could join it)."""
    return reuse_port_socket("127.0.0.1", 0)


@pytest.mark.parametrize("holder", [_plain_listener, _another_group])
def test_a_port_in_use_fails_the_api_before_any_process_starts(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, holder: Callable[[], socket.socket]
) -> None:
    held = holder()
    held.listen(1)
    port = held.getsockname()[1]
    try:
        done = _api_with_workers(redis_server, tiny_model, prefix, "--port", str(port))
    finally:
        held.close()
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr + done.stdout
    assert "processes, nodes" not in done.stderr + done.stdout  # refused before the banner and the start


def test_port_0_is_refused_with_several_processes(redis_server: EmbeddedRedis, tiny_model: Path, prefix: str) -> None:
    done = _api_with_workers(redis_server, tiny_model, prefix, "--port", "0")
    assert done.returncode == 2
    assert "--port 0 needs --workers 1" in done.stderr + done.stdout


def _api_with_workers(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPLITBUS_PREFIX": prefix, "SPLITBUS_REDIS_URL": redis_server.url}
    cmd = [*_python_splitbus(), "api", "--model", str(tiny_model), "--workers", "2", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def _python_splitbus() -> list[str]:
    return [sys.executable, "-m", "splitbus.cli.main"]


def test_a_tenants_rate_is_one_across_the_processes(redis_server: EmbeddedRedis, tiny_model: Path) -> None:
    """Its bucket is in Redis: one request per 100 s, whichever process each connection reaches
    (twelve connections of their own, spread by the kernel)."""
    prefix, key = f"proclimits{uuid.uuid4().hex[:6]}", "sk-procs-limits-key-0123"
    bus = BusConfig(redis_url=redis_server.url, prefix=prefix)

    async def add() -> None:
        client = connect(bus)
        await TenantStore(client, bus.keys).add(Tenant("acme", limits=TenantLimits(rps=0.01)), (key_digest(key),))
        await client.aclose()

    asyncio.run(add())
    responder = Responder(bus, ModelTokenizer.load(tiny_model, "tiny")).start()
    api = _two_processes(redis_server, tiny_model, prefix)
    try:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
        auth = {"authorization": f"Bearer {key}"}
        codes = [
            httpx.post(api.v1 + "/completions", json=body, headers=auth, timeout=30).status_code for _ in range(12)
        ]
        assert sorted(codes) == [200] + [429] * 11
    finally:
        stop_api(api)
        responder.stop()
