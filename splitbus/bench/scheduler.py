"""``splitbus bench scheduler``: how fast real scheduler processes place requests on many workers.

64 simulated workers (half prefill, half decode) are registered with leases kept alive; they
do no work, a reader just takes their tasks as they arrive. Two measures per replica count:

- **paced**: Poisson arrivals at ``rate`` requests/s; the latency from the request's XADD
  (its ``ts``) to its task being readable in a worker's stream;
- **flood**: ``flood_requests`` written at once; decisions (requests placed) per second from
  the first XADD to the last task read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np
import orjson
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT, KeyT, StreamIdT

from splitbus.bus import codec
from splitbus.bus.config import BusConfig
from splitbus.bus.connection import connect
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.registry import Registry, WorkerLoad, WorkerRecord
from splitbus.redis_server import die_with_parent

LEASE_MS = 3000
TaskReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]
"""XREAD's reply on this bench's client (RESP2, bytes): per stream, its name and its entries."""


class SchedulerStalled(Exception):
    """A phase ended with none of its requests placed: the schedulers are not working."""


@dataclass(frozen=True)
class SchedulerBenchConfig:
    workers: int = 64
    replicas: tuple[int, ...] = (1, 2)
    rate: float = 500.0
    paced_requests: int = 5000
    flood_requests: int = 20000
    prompt_tokens: int = 128
    max_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workers < 2 or not self.replicas or min(self.replicas) < 1:
            raise ValueError("workers must be >= 2 and replicas >= 1")
        if self.rate <= 0 or min(self.paced_requests, self.flood_requests) < 1:
            raise ValueError("rate and request counts must be positive")


class FakeWorkers:
    """Registered workers with live leases and a reader that records when each task shows up."""

    def __init__(self, redis: aioredis.Redis, bus: BusConfig, count: int) -> None:
        self.redis, self.bus = redis, bus
        self.registry = Registry(redis, bus)
        roles = ["prefill", "decode"] * (count // 2) + ["decode"] * (count % 2)
        load = WorkerLoad(free_kv_blocks=10**9, total_kv_blocks=10**9)
        self.records = [WorkerRecord(f"sim{i:03d}", role, "tiny", "sim", load=load) for i, role in enumerate(roles)]
        self.arrived: dict[str, float] = {}
        """request id -> when its first task was read."""
        self.tasks_read = 0
        self.stopped = False
        """Set to end the loops: they stop by themselves within one blocking read, because
        redis-py can swallow the cancellation of a blocked XREAD and leave a cancelled task
        running for good (the hang of issue 24)."""
        # From the start: "$" would skip a task written between two reads of a stream still at "$".
        self._cursors: dict[KeyT, StreamIdT] = {bus.keys.tasks(r.worker_id): "0-0" for r in self.records}

    async def register(self) -> None:
        for record in self.records:
            await self.registry.register(record, LEASE_MS)

    async def keep_alive(self) -> None:
        while not self.stopped:
            await asyncio.sleep(0.5)
            for record in self.records:
                await self.registry.heartbeat(record.worker_id, record.load, LEASE_MS)

    async def read_tasks(self) -> None:
        while not self.stopped:
            reply = cast(TaskReply, await self.redis.xread(self._cursors, count=1000, block=500))
            now = time.time()
            for key, entries in reply or ():
                self._cursors[key.decode()] = entries[-1][0].decode()
                self.tasks_read += len(entries)
                for _, fields in entries:  # only the id: full decoding would slow the measurement
                    self.arrived.setdefault(orjson.loads(fields[b"data"])["request"]["request_id"], now)


def _request(i: int, config: SchedulerBenchConfig) -> GenerateRequest:
    return GenerateRequest(
        f"b{i}-{uuid.uuid4().hex[:8]}",
        "tiny",
        [97] * config.prompt_tokens,
        SamplingParams(max_tokens=config.max_tokens),
        "bench",
        0,
    )


def _entry(request: GenerateRequest) -> tuple[dict[FieldT, EncodableT], float]:
    """The request's stream entry, as redis-py's XADD is typed to take it, and its ``ts`` (the
    publish time) in seconds."""
    fields = codec.encode(request)
    return dict(fields.items()), int(fields[b"ts"]) / 1e6


async def _paced(
    redis: aioredis.Redis, bus: BusConfig, workers: FakeWorkers, config: SchedulerBenchConfig
) -> dict[str, Any]:
    rng = np.random.default_rng(config.seed)
    gaps = rng.exponential(1.0 / config.rate, config.paced_requests)
    sent: dict[str, float] = {}
    start = time.perf_counter()
    for i, at in enumerate(np.cumsum(gaps)):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        request = _request(i, config)
        fields, sent[request.request_id] = _entry(request)
        await redis.xadd(bus.keys.requests, fields)
    sending_s = time.perf_counter() - start
    await _until(lambda: all(r in workers.arrived for r in sent), _placing_s(len(sent)))
    latency_ms = np.array([(workers.arrived[r] - t) * 1000 for r, t in sent.items() if r in workers.arrived])
    if not latency_ms.size:
        raise SchedulerStalled(f"none of {len(sent)} paced requests was placed within {_placing_s(len(sent)):.0f} s")
    return {
        "requests": len(sent),
        "placed": len(latency_ms),
        "offered_rate": config.rate,
        "achieved_rate": len(sent) / sending_s,
        **{f"p{p}_ms": float(np.percentile(latency_ms, p)) for p in (50, 90, 99, 99.9)},
        "max_ms": float(latency_ms.max()),
        "cdf_ms": np.percentile(latency_ms, np.linspace(0, 100, 200)).round(3).tolist(),
    }


async def _flood(
    redis: aioredis.Redis, bus: BusConfig, workers: FakeWorkers, config: SchedulerBenchConfig
) -> dict[str, Any]:
    requests = [_request(i, config) for i in range(config.flood_requests)]
    before = len(workers.arrived)
    start = time.time()
    for chunk in range(0, len(requests), 1000):
        pipe = redis.pipeline(transaction=False)
        for request in requests[chunk : chunk + 1000]:
            pipe.xadd(bus.keys.requests, _entry(request)[0])
        await pipe.execute()
    written = time.time()
    await _until(lambda: len(workers.arrived) - before >= len(requests), _placing_s(len(requests)))
    placed = sum(1 for r in requests if r.request_id in workers.arrived)
    if not placed:
        raise SchedulerStalled(
            f"none of {len(requests)} flood requests was placed within {_placing_s(len(requests)):.0f} s"
        )
    last = max(workers.arrived[r.request_id] for r in requests if r.request_id in workers.arrived)
    return {
        "requests": len(requests),
        "placed": placed,
        "write_s": written - start,
        "elapsed_s": last - start,
        "decisions_per_s": placed / (last - start),
    }


def _placing_s(requests: int) -> float:
    """How long to wait for the last of a phase's requests to be placed: well past any
    measured rate (over 1,000 decisions/s), so that a phase that stalls ends as a report of
    fewer placed than sent, not as a hang."""
    return max(10.0, requests / 200)


async def _until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _start_schedulers(url: str, prefix: str, count: int) -> list[subprocess.Popen[bytes]]:
    # The URL (it may hold a password) goes in the environment, never on argv.
    env = {**os.environ, "SPLITBUS_PREFIX": prefix, "SPLITBUS_LOG_LEVEL": "WARNING", "SPLITBUS_REDIS_URL": url}
    cmd = [sys.executable, "-m", "splitbus.cli.main", "scheduler"]
    return [
        subprocess.Popen(
            [*cmd, "--name", f"bench-scheduler-{i}"], env=env, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        for i in range(count)
    ]


async def _one_setting(
    url: str, config: SchedulerBenchConfig, replicas: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    bus = BusConfig(redis_url=url, prefix=f"bs{uuid.uuid4().hex[:6]}")
    redis = connect(bus, max_connections=8, name="bench-scheduler")
    workers = FakeWorkers(redis, bus, config.workers)
    await workers.register()
    background = [asyncio.create_task(workers.keep_alive()), asyncio.create_task(workers.read_tasks())]
    schedulers = _start_schedulers(url, bus.prefix, replicas)
    try:
        await asyncio.sleep(2.0)  # the schedulers start, create the group and read the registry
        progress(
            f"{replicas} scheduler(s), {config.workers} workers: {config.paced_requests} requests at {config.rate:g}/s"
        )
        paced = await _paced(redis, bus, workers, config)
        progress(f"{replicas} scheduler(s): flood of {config.flood_requests} requests")
        flood = await _flood(redis, bus, workers, config)
    finally:
        for proc in schedulers:
            proc.terminate()
        for proc in schedulers:
            proc.wait(30)
        await _stop(workers, background, redis)
    return {"replicas": replicas, "workers": config.workers, "paced": paced, "flood": flood}


async def _stop(workers: FakeWorkers, background: list[asyncio.Task[None]], redis: aioredis.Redis) -> None:
    """End the fake workers' loops and close the client, each within a bound: the benchmark
    must end even when a loop or the client does not."""
    workers.stopped = True
    _, stuck = await asyncio.wait(background, timeout=5.0)
    for task in stuck:
        task.cancel()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(redis.aclose(), 5.0)


def run_scheduler_bench(url: str, config: SchedulerBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    results = [asyncio.run(_one_setting(url, config, replicas, progress)) for replicas in config.replicas]
    return {"config": asdict(config), "results": results}
