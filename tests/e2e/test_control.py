"""Control commands and external dispatch against real worker processes, with no scheduler:
what an external module in any language sees over Redis."""

from __future__ import annotations

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

from splitbus.bus.config import BusConfig
from splitbus.bus.control import call
from splitbus.bus.connection import connect
from splitbus.redis_server import EmbeddedRedis, free_port
from splitbus.worker.sim import sim_text

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
    cmd = [sys.executable, "-m", "splitbus.cli.main", "worker", "--role", role, "--engine", "sim", "--model", str(model),
           "--redis-url", url, "--worker-id", worker_id, "--kv-blocks", "512", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env)


@pytest.fixture(scope="module")
def workers(redis_server: EmbeddedRedis, tiny_model: Path) -> Iterator[Workers]:
    prefix, port = f"c{uuid.uuid4().hex[:8]}", free_port()
    procs = [_worker("prefill", "p0", tiny_model, redis_server.url, prefix, "--metrics-port", str(port)),
             _worker("decode", "d0", tiny_model, redis_server.url, prefix)]
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    deadline = time.monotonic() + 60
    while client.zcard(f"{prefix}:workers") < 2 or not all(client.exists(f"{prefix}:lease:{{{w}}}") for w in ("p0", "d0")):
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


async def test_get_metrics_is_the_workers_prometheus_text(workers: Workers) -> None:
    reply = await _call(workers, "p0", "get_metrics")
    assert reply.ok and "splitbus_worker_kv_blocks_capacity 512.0" in reply.result["text"]
    served = urllib.request.urlopen(f"http://127.0.0.1:{workers.metrics_port}/metrics", timeout=10).read().decode()
    assert "splitbus_worker_kv_blocks_capacity 512.0" in served and "splitbus_bus_entries_produced_total" in served


async def test_connect_rdma_connects_and_records_the_link(workers: Workers) -> None:
    reply = await _call(workers, "p0", "connect_rdma", {"decode_worker": "d0"})
    assert reply.ok and reply.result["state"] == "connected"
    link = redis.Redis.from_url(workers.redis_url, decode_responses=True).hgetall(f"{workers.prefix}:rdma:{{p0}}:{{d0}}")
    assert link["state"] == "connected" and link["prefill"] == "p0" and link["decode"] == "d0"


@pytest.mark.parametrize(("worker", "args", "error"), [
    ("d0", {"decode_worker": "p0"}, "d0 is a decode worker; send connect_rdma to the prefill worker"),
    ("p0", {}, "connect_rdma needs args.decode_worker"),
    ("p0", {"decode_worker": "nobody"}, "no live worker 'nobody' in the registry"),
    ("p0", {"decode_worker": "d9", "endpoint": "127.0.0.1:1"}, "could not connect to d9 at 127.0.0.1:1"),
])
async def test_connect_rdma_failures_say_why(workers: Workers, worker: str, args: dict, error: str) -> None:
    reply = await _call(workers, worker, "connect_rdma", args)
    assert not reply.ok and error in reply.error
    after = await _call(workers, worker, "get_payload")  # the worker goes on
    assert after.ok


def test_a_refused_connection_is_recorded_as_failed(workers: Workers) -> None:
    link = redis.Redis.from_url(workers.redis_url, decode_responses=True).hgetall(f"{workers.prefix}:rdma:{{p0}}:{{d9}}")
    assert link["state"] == "failed" and link["error"]


def test_the_external_dispatcher_example_drives_a_request_through_p_and_d(workers: Workers) -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--redis-url", workers.redis_url, "--prefix", workers.prefix,
                          "--max-tokens", "9", "--seed", "42"], capture_output=True, text=True, timeout=90, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "p0 -> d0: connected" in out.stdout
    tokens = [line for line in out.stdout.splitlines() if line.startswith("token ")]
    assert len(tokens) >= 2  # the first token from P, the rest from D
    final = out.stdout.splitlines()[-1]
    assert final.startswith("final ") and '"finish_reason": "length"' in final and '"completion_tokens": 9' in final
    text = "".join(json.loads(line.split(" ", 1)[1])["text"] for line in out.stdout.splitlines() if line.startswith(("token ", "final ")))
    assert text == sim_text(42, 9)


def test_splitbus_ctl_prints_the_reply_and_exits_by_it(workers: Workers) -> None:
    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SPLITBUS_PREFIX": workers.prefix}
        return subprocess.run([sys.executable, "-m", "splitbus.cli.main", "ctl", *args, "--redis-url", workers.redis_url],
                              capture_output=True, text=True, timeout=30, env=env, check=False)

    payload = ctl("p0", "get_payload")
    assert payload.returncode == 0 and json.loads(payload.stdout)["result"]["role"] == "prefill"
    refused = ctl("p0", "connect_rdma", "--arg", "decode_worker=nobody")
    assert refused.returncode == 1 and "no live worker 'nobody'" in json.loads(refused.stdout)["error"]
    metrics = ctl("d0", "get_metrics")
    assert metrics.returncode == 0 and "# TYPE splitbus_worker_kv_blocks_free gauge" in metrics.stdout
    missing = ctl("ghost", "get_payload", "--timeout", "0.3")
    assert missing.returncode == 2 and "worker ghost did not answer get_payload within 0.3 s" in missing.stdout
