"""``splitbus bench api``: many concurrent streaming requests through one API (``--workers N``).

One ``splitbus api`` with N processes on its port (one run per N asked for, each on a fresh API
and key prefix); a responder process stands in for scheduler and workers (it takes requests from
``sb:requests:{cell}`` and writes one token per request every ``step_ms`` through the
``ResultWriter``, as a worker does); client processes hold the streams open over HTTP. Measured
per N: the tokens per second the clients receive, the streams that failed and those reset by the
server, the Redis connections the API processes hold (``CLIENT LIST``, by client name, sampled
during the run), the commands Redis processed (``INFO stats``) and the load average after the run;
once, the kernel's ``somaxconn`` (each process's listen backlog is the smaller of it and the API's).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from splitbus import aio
from splitbus.bus.roles import Role

USAGE = re.compile(rb'"completion_tokens":(\d+)')
RESET = ConnectionResetError.__name__
"""A stream the server reset (its accept queue full, or a process gone) reads as this error."""


@dataclass(frozen=True)
class ApiBenchConfig:
    streams: int = 1000
    tokens: int = 256
    """Tokens per stream."""
    step_ms: float = 20.0
    """The responder's step: every stream gets a token per step."""
    client_processes: int = 2
    api_workers: tuple[int, ...] = (1,)
    """The API's process counts (``splitbus api --workers N``): one run each, in this order."""

    def __post_init__(self) -> None:
        if min(self.streams, self.tokens, self.client_processes) < 1 or self.step_ms <= 0:
            raise ValueError("streams, tokens, client_processes and step_ms must be positive")
        if not self.api_workers or min(self.api_workers) < 1:
            raise ValueError("api_workers: one or more process counts, each >= 1")


def _respond(url: str, prefix: str, config: ApiBenchConfig, stop: Any) -> None:
    """The responder process: registers a worker for model ``tiny`` and answers every request."""
    from splitbus.bus.core.config import BusConfig
    from splitbus.bus.core.connection import connect
    from splitbus.bus.core.keys import SCHEDULER_GROUP
    from splitbus.bus.core.streams import GroupConsumer
    from splitbus.bus.messages import GenerateRequest
    from splitbus.bus.registry import Registry, WorkerLoad, WorkerRecord
    from splitbus.bus.results import ResultWriter

    async def main() -> None:
        bus = BusConfig(redis_url=url, prefix=prefix, block_ms=50)
        redis = connect(bus, max_connections=4, name="bench-responder")
        registry, writer = Registry(redis, bus), ResultWriter(redis, bus)
        record = WorkerRecord(
            "bench-responder", Role.MIXED, "tiny", "sim", load=WorkerLoad(free_kv_blocks=10**9, total_kv_blocks=10**9)
        )
        requests = GroupConsumer(redis, bus, bus.keys.requests, SCHEDULER_GROUP, "bench-responder")
        await requests.ensure_group()
        remaining: dict[str, list[int]] = {}  # request id -> [tokens left, tokens in all]
        next_beat = 0.0
        while not stop.is_set():
            step_started = time.monotonic()
            if step_started > next_beat:
                await registry.register(record, 3000)
                next_beat = step_started + 0.5
            deliveries = await requests.read(10_000, block_ms=0)
            for request in [d.message for d in deliveries if isinstance(d.message, GenerateRequest)]:
                writer.open(request.request_id, reader=request.reader)
                remaining[request.request_id] = [request.sampling.max_tokens] * 2
            await requests.ack(*[d.entry_id for d in deliveries])
            for request_id in list(remaining):
                _one_token(writer, remaining, request_id)
            await writer.flush()
            await asyncio.sleep(max(0.0, config.step_ms / 1000 - (time.monotonic() - step_started)))
        await redis.aclose()

    asyncio.run(main())


def _one_token(writer: Any, remaining: dict[str, list[int]], request_id: str) -> None:
    writer.tokens(request_id, [97], "a")
    left = remaining[request_id]
    left[0] -= 1
    if left[0] == 0:
        del remaining[request_id]
        writer.finish(request_id, "length", 1, left[1])


def _client(base_url: str, streams: int, tokens: int, results: Any) -> None:
    """A client process: ``streams`` concurrent streamed completions; reports what it got.

    It speaks just enough HTTP/1.1 over asyncio streams to send the request and count what
    comes back (like wrk, it does not parse each event): an HTTP library's per-chunk work would
    take the CPU that the API process under test needs on a small machine."""
    host, port = base_url.removeprefix("http://").split(":")
    body = orjson.dumps(
        {
            "model": "tiny",
            "prompt": [97],
            "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()

    async def one() -> tuple[int, str]:
        """Tokens received, or 0 and what went wrong (an exception's type name first)."""
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head + body)
            first, tail = b"", b""
            while chunk := await reader.read(65536):
                first = first or chunk[:12]
                tail = (tail + chunk)[-300:]
            writer.close()
        except OSError as exc:
            return 0, f"{type(exc).__name__}: {exc}"
        if not first.startswith(b"HTTP/1.1 200"):
            return 0, first.decode(errors="replace")
        match = USAGE.search(tail)
        return (int(match.group(1)), "") if match else (0, "no usage chunk")

    async def main() -> None:
        started = time.time()
        done = await asyncio.gather(*(one() for _ in range(streams)))
        results.put(
            {
                "started": started,
                "ended": time.time(),
                "tokens": sum(t for t, _ in done),
                "completed": sum(1 for t, _ in done if t == tokens),
                "resets": sum(1 for _, e in done if e.startswith(RESET)),
                "errors": sorted({e for _, e in done if e})[:3],
            }
        )

    aio.run(main())


def _api_connections(url: str, node: str) -> int:
    """Connections of the API's processes (each names its own ``<node>-i``, or ``<node>`` alone)."""
    return sum(1 for name in _client_names(url) if name.startswith(node))


def _client_names(url: str) -> list[str]:
    """The name of each client connected to Redis (``CLIENT LIST``)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        return [c.get("name", "") for c in client.client_list()]
    finally:
        client.close()


def _commands(url: str) -> int:
    """Commands the Redis server has processed since it started."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("stats")["total_commands_processed"])
    finally:
        client.close()


def somaxconn() -> int | None:
    """The kernel's cap on a listen backlog (``net.core.somaxconn``), None where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return None


def _start_api(
    url: str, prefix: str, model_dir: Path, port: int, node: str, streams: int, workers: int
) -> subprocess.Popen[bytes]:
    from splitbus.redis_server import die_with_parent

    # The URL (it holds a password) goes in the environment, never on argv.
    env = {**os.environ, "SPLITBUS_PREFIX": prefix, "SPLITBUS_LOG_LEVEL": "WARNING", "SPLITBUS_REDIS_URL": url}
    cmd = [
        sys.executable,
        "-m",
        "splitbus.cli.main",
        "api",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--node-id",
        node,
        "--max-inflight",
        str(streams * 2),
        "--workers",
        str(workers),
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent)


def _wait_ready(base_url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"{base_url}/ready", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the API did not become ready")


def _tiny_model(data: Path) -> Path:
    """The sim engine's default model (a tokenizer and ``config.json``, what ``splitbus up --engine
    sim`` serves), made in ``data``."""
    from splitbus.worker import engines

    folder = data / "tiny"
    engines.get("sim").make_default_model(folder)
    return folder


def run_api_bench(url: str, config: ApiBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """One run per process count in ``config.api_workers``; the report holds a row for each."""
    runs = [_run_once(url, config, workers, progress) for workers in config.api_workers]
    return {"config": asdict(config), "cpus": os.cpu_count(), "somaxconn": somaxconn(), "runs": runs}


def _run_once(url: str, config: ApiBenchConfig, workers: int, progress: Callable[[str], None]) -> dict[str, Any]:
    from splitbus.redis_server import free_port

    prefix, node, port = f"ba{uuid.uuid4().hex[:6]}", f"bench-api-{uuid.uuid4().hex[:6]}", free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="splitbus-bench-api-") as data:
        api = _start_api(url, prefix, _tiny_model(Path(data)), port, node, config.streams, workers)
        stop = mp.Event()
        results: mp.Queue[dict[str, Any]] = mp.Queue()
        responder = mp.Process(target=_respond, args=(url, prefix, config, stop), daemon=True)
        responder.start()
        try:
            _wait_ready(base_url)
            _wait_connected(url, node, workers)
            progress(
                f"{config.streams} streams of {config.tokens} tokens through {workers} API process(es) "
                f"({config.client_processes} client processes)"
            )
            commands = _commands(url)
            clients = [
                mp.Process(target=_client, args=(base_url, n, config.tokens, results), daemon=True)
                for n in _shares(config.streams, config.client_processes)
            ]
            for c in clients:
                c.start()
            peak = _sample_connections(url, node, clients)
            reports = [results.get(timeout=60) for _ in clients]
            commands = _commands(url) - commands
        finally:
            stop.set()
            api.terminate()
            api.wait(30)
            responder.join(10)
    return _summary(config, workers, reports, peak, commands)


def _shares(streams: int, clients: int) -> list[int]:
    """The streams each client process holds: as even as they divide."""
    return [streams // clients + (i < streams % clients) for i in range(clients)]


def _wait_connected(url: str, node: str, workers: int, timeout_s: float = 60) -> None:
    """Until every API process holds a Redis connection (one answering /ready does not mean all are
    up; the kernel would queue the others' share until they serve, which the run would count)."""
    names = {node} if workers == 1 else {f"{node}-{i}" for i in range(workers)}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if names <= set(_client_names(url)):
            return
        time.sleep(0.2)
    raise RuntimeError(f"not every API process connected within {timeout_s:g} s")


def _sample_connections(url: str, node: str, clients: list[Any]) -> int:
    peak = 0
    while any(c.is_alive() for c in clients):
        peak = max(peak, _api_connections(url, node))
        time.sleep(0.25)
    return peak


def _summary(
    config: ApiBenchConfig, workers: int, reports: list[dict[str, Any]], peak: int, commands: int
) -> dict[str, Any]:
    started, ended = min(r["started"] for r in reports), max(r["ended"] for r in reports)
    tokens = sum(r["tokens"] for r in reports)
    completed = sum(r["completed"] for r in reports)
    return {
        "api_workers": workers,
        "streams": config.streams,
        "completed": completed,
        "failed": config.streams - completed,
        "resets": sum(r["resets"] for r in reports),
        "tokens": tokens,
        "seconds": ended - started,
        "tokens_per_s": tokens / (ended - started),
        "offered_tokens_per_s": config.streams * 1000 / config.step_ms,
        "api_redis_connections_peak": peak,
        "redis_commands": commands,
        "redis_commands_per_token": commands / tokens if tokens else None,
        "load_average_1m": os.getloadavg()[0],
        "errors": sorted({e for r in reports for e in r["errors"]}),
    }
