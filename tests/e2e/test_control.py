"""Control commands and external dispatch against real worker processes, with no scheduler:
what an external module in any language sees over Redis."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from splitbus.bus.control import call
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.core.keys import Keys
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.redis_server import EmbeddedRedis, free_port
from splitbus.worker.engines.sim import sim_text

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "external_dispatcher.py"


@dataclass
class Workers:
    redis_url: str
    prefix: str
    metrics_port: int
    procs: list[subprocess.Popen[str]]

    @property
    def bus(self) -> BusConfig:
        return BusConfig(redis_url=self.redis_url, prefix=self.prefix)


def _worker(role: str, worker_id: str, model: Path, url: str, prefix: str, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "SPLITBUS_PREFIX": prefix, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "splitbus.cli.main",
        "worker",
        "--role",
        role,
        "--engine",
        "sim",
        "--model",
        str(model),
        "--redis-url",
        url,
        "--worker-id",
        worker_id,
        "--kv-blocks",
        "512",
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env)


@pytest.fixture(scope="module")
def workers(redis_server: EmbeddedRedis, tiny_model: Path) -> Iterator[Workers]:
    prefix, port = f"c{uuid.uuid4().hex[:8]}", free_port()
    procs = [
        _worker("prefill", "p0", tiny_model, redis_server.url, prefix, "--metrics-port", str(port)),
        _worker("decode", "d0", tiny_model, redis_server.url, prefix),
    ]
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    deadline = time.monotonic() + 60
    while client.zcard(Keys(prefix).workers) < 2 or not all(client.exists(Keys(prefix).lease(w)) for w in ("p0", "d0")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "workers did not register"
        time.sleep(0.1)
    yield Workers(redis_server.url, prefix, port, procs)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        assert proc.wait(30) == 0


async def _call(workers: Workers, worker: str, cmd: str, args: dict | None = None):  # type: ignore[no-untyped-def]
    client = connect(workers.bus)
    try:
        return await call(client, workers.bus, worker, cmd, args)
    finally:
        await client.aclose()


async def test_get_payload_describes_each_worker(workers: Workers, tiny_model: Path) -> None:
    prefill = await _call(workers, "p0", "get_payload")
    decode = await _call(workers, "d0", "get_payload")
    assert prefill.ok and decode.ok
    assert (prefill.result["role"], decode.result["role"]) == ("prefill", "decode")
    assert prefill.result["total_kv_blocks"] == 512 and prefill.result["block_size"] == 16
    assert prefill.result["max_batch_size"] == 64 and prefill.result["max_input_length"] == 512
    assert prefill.result["unhandled_requests"] == 0 and prefill.result["dp_rank"] == -1
    assert decode.result["transfer_endpoint"].startswith("127.0.0.1:")
    assert "experts" in prefill.result and prefill.result["experts"] is None  # the sim engine has no experts


async def test_get_metrics_is_the_workers_prometheus_text(workers: Workers) -> None:
    reply = await _call(workers, "p0", "get_metrics")
    assert reply.ok and "splitbus_worker_kv_blocks_capacity 512.0" in reply.result["text"]
    served = urllib.request.urlopen(f"http://127.0.0.1:{workers.metrics_port}/metrics", timeout=10).read().decode()
    assert "splitbus_worker_kv_blocks_capacity 512.0" in served and "splitbus_bus_entries_produced_total" in served


async def test_connect_rdma_connects_and_records_the_link(workers: Workers) -> None:
    reply = await _call(workers, "p0", "connect_rdma", {"decode_worker": "d0"})
    assert reply.ok and reply.result["state"] == "connected"
    link = redis.Redis.from_url(workers.redis_url, decode_responses=True).hgetall(
        f"{workers.prefix}:rdma:{{p0}}:{{d0}}"
    )
    assert link["state"] == "connected" and link["prefill"] == "p0" and link["decode"] == "d0"


@pytest.mark.parametrize(
    ("worker", "args", "error"),
    [
        ("d0", {"decode_worker": "p0"}, "d0 is a decode worker; send connect_rdma to the prefill worker"),
        ("p0", {}, "connect_rdma needs args.decode_worker"),
        ("p0", {"decode_worker": "nobody"}, "no live worker 'nobody' in the registry"),
        ("p0", {"decode_worker": "p0"}, "p0 is a prefill worker with no KV endpoint to connect to"),
    ],
)
async def test_connect_rdma_failures_say_why(workers: Workers, worker: str, args: dict, error: str) -> None:
    reply = await _call(workers, worker, "connect_rdma", args)
    assert not reply.ok and error in reply.error
    after = await _call(workers, worker, "get_payload")  # the worker goes on
    assert after.ok


class Listener:
    """Someone else's server on loopback: counts the connections that reach it."""

    def __init__(self) -> None:
        self.connections = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._count, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _count(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.close()


@pytest.mark.parametrize("decode_worker", ["d0", "nobody"])
async def test_connect_rdma_to_an_unregistered_endpoint_is_refused_unconnected(
    workers: Workers, decode_worker: str
) -> None:
    # The attack: make P connect (and later send KV) to a host:port of the caller's choosing.
    listener = Listener()
    endpoint = await listener.start()
    try:
        reply = await _call(workers, "p0", "connect_rdma", {"decode_worker": decode_worker, "endpoint": endpoint})
        assert not reply.ok and listener.connections == 0
        expected = (
            f"{endpoint!r} is not d0's registered KV endpoint" if decode_worker == "d0" else "no live worker 'nobody'"
        )
        assert expected in reply.error
        recorded = redis.Redis.from_url(workers.redis_url, decode_responses=True).hgetall(
            f"{workers.prefix}:rdma:{{p0}}:{{{decode_worker}}}"
        )
        assert recorded.get("endpoint") != endpoint  # no link to it was even requested
    finally:
        listener.server.close()
    assert (await _call(workers, "p0", "get_payload")).ok


async def test_a_registered_worker_that_refuses_the_connection_is_recorded_as_failed(workers: Workers) -> None:
    client = connect(workers.bus)
    try:  # a live decode worker's record whose endpoint nothing listens on
        record = WorkerRecord(worker_id="d9", role="decode", model="tiny", transfer_endpoint=f"127.0.0.1:{free_port()}")
        await Registry(client, workers.bus).register(record, lease_ms=30_000)
        reply = await _call(workers, "p0", "connect_rdma", {"decode_worker": "d9"})
        assert not reply.ok and f"could not connect to d9 at {record.transfer_endpoint}" in reply.error
        link = await client.hgetall(workers.bus.keys.rdma("p0", "d9"))
        assert link[b"state"] == b"failed" and link[b"error"]
    finally:
        await Registry(client, workers.bus).deregister("d9")
        await client.aclose()


def test_the_external_dispatcher_example_drives_a_request_through_p_and_d(workers: Workers) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--redis-url",
            workers.redis_url,
            "--prefix",
            workers.prefix,
            "--max-tokens",
            "9",
            "--seed",
            "42",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "p0 -> d0: connected" in out.stdout
    tokens = [line for line in out.stdout.splitlines() if line.startswith("token ")]
    assert len(tokens) >= 2  # the first token from P, the rest from D
    final = out.stdout.splitlines()[-1]
    assert final.startswith("final ") and '"finish_reason": "length"' in final and '"completion_tokens": 9' in final
    text = "".join(
        json.loads(line.split(" ", 1)[1])["text"]
        for line in out.stdout.splitlines()
        if line.startswith(("token ", "final "))
    )
    assert text == sim_text(42, 9)


def test_splitbus_ctl_prints_the_reply_and_exits_by_it(workers: Workers) -> None:
    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SPLITBUS_PREFIX": workers.prefix}
        return subprocess.run(
            [sys.executable, "-m", "splitbus.cli.main", "ctl", *args, "--redis-url", workers.redis_url],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
            check=False,
        )

    payload = ctl("p0", "get_payload")
    assert payload.returncode == 0 and json.loads(payload.stdout)["result"]["role"] == "prefill"
    refused = ctl("p0", "connect_rdma", "--arg", "decode_worker=nobody")
    assert refused.returncode == 1 and "no live worker 'nobody'" in json.loads(refused.stdout)["error"]
    metrics = ctl("d0", "get_metrics")
    assert metrics.returncode == 0 and "# TYPE splitbus_worker_kv_blocks_free gauge" in metrics.stdout
    missing = ctl("ghost", "get_payload", "--timeout", "0.3")
    assert missing.returncode == 2 and "worker ghost did not answer get_payload within 0.3 s" in missing.stdout


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({}, "drain needs 0 < args.timeout_s <= 86400 (the worker has no --drain-timeout: give one)"),
        ({"timeout_s": "soon"}, "drain takes args.timeout_s, a number of seconds"),
        ({"timeout_s": True}, "drain takes args.timeout_s, a number of seconds"),
        ({"timeout_s": -1}, "drain needs 0 < args.timeout_s <= 86400"),
        ({"timeout_s": 1e9}, "drain needs 0 < args.timeout_s <= 86400"),
    ],
)
async def test_a_drain_command_out_of_bounds_is_refused_and_the_worker_goes_on(
    workers: Workers, args: dict, error: str
) -> None:
    reply = await _call(workers, "d0", "drain", args)
    assert not reply.ok and reply.error.endswith(error)
    assert (await _call(workers, "d0", "get_payload")).ok


async def test_a_drain_command_drains_the_worker_which_leaves_and_exits_0(workers: Workers, tiny_model: Path) -> None:
    """For orchestrators that cannot signal a worker: as SIGTERM with --drain-timeout does."""
    proc = _worker("decode", "d-ctl", tiny_model, workers.redis_url, workers.prefix)
    client = redis.Redis.from_url(workers.redis_url, decode_responses=True)
    try:
        deadline = time.monotonic() + 60
        while not client.exists(Keys(workers.prefix).lease("d-ctl")):
            assert time.monotonic() < deadline and proc.poll() is None, "d-ctl did not register"
            time.sleep(0.1)
        reply = await _call(workers, "d-ctl", "drain", {"timeout_s": 5})
        assert reply.ok and reply.result == {"state": "draining", "timeout_s": 5.0, "already": False}
        assert await asyncio.to_thread(proc.wait, 30) == 0
        assert "d-ctl" not in client.zrange(Keys(workers.prefix).workers, 0, -1)
    finally:
        if proc.poll() is None:
            proc.kill()
        client.close()
