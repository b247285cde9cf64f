"""``splitbus bench scheduler``: how fast real processes place requests on many workers.

64 (or 256, ``workers``) simulated workers (half prefill, half decode) are registered with
leases kept alive; they do no work, a reader just takes their tasks as they arrive. Each setting
is scheduler replicas placing what the request stream brings (``replicas``), or API processes
placing requests themselves (``api_dispatchers``: ``splitbus api --dispatch api``'s
``ApiPlacer``, each generating its share of the requests). Two measures per setting:

- **paced**: Poisson arrivals at ``rate`` requests/s (split evenly among API dispatchers); the
  latency from the request's XADD (its ``ts``; an API dispatcher: the moment it has the request
  and starts placing it) to its task being readable in a worker's stream;
- **flood**: ``flood_requests`` at once; decisions (requests placed) per second from the first
  XADD (the first placement) to the last task read.

Before the settings, ``decisions`` in-process decisions per worker count time the policy alone,
as it reads the candidates now (columns) and as it did before (rows): ``splitbus.bench.decisions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
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
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.typing import EncodableT, FieldT

from splitbus import aio
from splitbus.bench.decisions import BLOCK_SIZE, measure_decisions
from splitbus.bus.blocks import chain_hex
from splitbus.bus.core import cluster, codec, follow
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.kv_events import KvEventPublisher
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.records import WorkerLoad
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.bus.roles import Role
from splitbus.redis_server import die_with_parent

LEASE_MS = 3000
READ_BLOCK_MS = 1000
"""How long one fake worker's read waits: under the client's socket timeout, as a worker's."""
BENCH_GROUP = "bench"
"""The fake workers' group on their task streams (not the workers' group: nothing else sees it)."""
STREAMS_PER_READER = 16
"""Task streams one fake reader blocks on (``FakeWorkers.read_tasks``)."""
BEAT_SLICES = 10
"""The fake workers beat in this many slices, spread over each 0.5 s (``FakeWorkers.keep_alive``)."""
Progress = Callable[[str], None]
TaskReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]
"""XREAD's reply on this bench's client (RESP2, bytes): per stream, its name and its entries."""


class SchedulerStalled(Exception):
    """A phase ended with none of its requests placed: the schedulers are not working."""


@dataclass(frozen=True)
class SchedulerBenchConfig:
    workers: tuple[int, ...] = (64,)
    """Registered workers of each run (one run per count and setting)."""
    replicas: tuple[int, ...] = (1, 2)
    """Scheduler processes of each scheduler setting."""
    api_dispatchers: tuple[int, ...] = ()
    """API processes placing requests themselves, of each API setting."""
    rate: float = 500.0
    paced_requests: int = 5000
    flood_requests: int = 20000
    decisions: int = 20000
    """In-process decisions timed per worker count, columns vs rows (``bench.decisions``; 0: none)."""
    prompt_tokens: int = 128
    max_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.workers or min(self.workers) < 2 or min((*self.replicas, *self.api_dispatchers), default=0) < 1:
            raise ValueError("workers must be >= 2, and replicas and API dispatchers >= 1")
        if not self.replicas and not self.api_dispatchers:
            raise ValueError("give scheduler replicas or API dispatchers to measure")
        if self.rate <= 0 or min(self.paced_requests, self.flood_requests) < 1 or self.decisions < 0:
            raise ValueError("rate and request counts must be positive (decisions: >= 0)")


class FakeWorkers:
    """Registered workers with live leases and a reader that records when each task shows up."""

    def __init__(self, redis: aioredis.Redis, bus: BusConfig, count: int) -> None:
        self.redis, self.bus = redis, bus
        self.registry = Registry(redis, bus)
        roles = [Role.PREFILL, Role.DECODE] * (count // 2) + [Role.DECODE] * (count % 2)
        load = WorkerLoad(free_kv_blocks=10**9, total_kv_blocks=10**9)
        self.records = [
            WorkerRecord(f"sim{i:03d}", role, "tiny", "sim", load=load, block_size=BLOCK_SIZE)
            for i, role in enumerate(roles)
        ]
        self.arrived: dict[str, float] = {}
        """request id -> when its first task was read."""
        self.tasks_read = 0
        self.stopped = False
        """Set (by ``stop``) to end the loops: each stops by itself, within one beat, or as its
        connection is closed under its blocked read, never by cancellation, because redis-py can
        swallow the cancellation of a blocked read and leave the task running for good (the
        hang of issue 24)."""
        # From the start: "$" would skip a task written between two reads of a stream still at "$".
        self._cursors: dict[str, str] = {bus.keys.tasks(r.worker_id): "0-0" for r in self.records}
        self._readers: list[aioredis.Connection] = []

    async def register(self) -> None:
        for record in self.records:
            await self.registry.register(record, LEASE_MS)
            # as a worker starts: a fresh (empty) cache announced, so schedulers need not ask for one
            await KvEventPublisher(self.redis, self.bus, record.worker_id).start()

    async def keep_alive(self) -> None:
        """Every worker beats every 0.5 s, spread over the interval as independent workers'
        beats are: a tenth of them every 50 ms, at once. (One after another, a round of 256
        beats took up to 1.7 s while the bench read a flood's tasks, and leases ran out; all at
        once, each round was a burst of 256 scripts that arrivals queued behind.)"""
        slices = [self.records[i::BEAT_SLICES] for i in range(BEAT_SLICES)]
        while not self.stopped:
            for beating in slices:
                await asyncio.sleep(0.5 / BEAT_SLICES)
                await asyncio.gather(*(self.registry.heartbeat(r.worker_id, r.load, LEASE_MS) for r in beating))

    async def read_tasks(self) -> None:
        """Note when each task arrives, as its worker would read it. On a single Redis the
        streams are read in groups of ``STREAMS_PER_READER``, each group by one blocking
        ``XREADGROUP`` (at ``>``, no pending list) packed once, on a connection of its own. One
        ``XREAD`` of all 256 streams cost Redis ~340 µs a wake (it blocks on, and wakes from,
        every key) and the bench the packing of 512 arguments: its lag went into the measured
        latency. One reader per stream, as real workers read, made a flood's tasks 40,000
        wakes of the bench. ``stop`` closes the connections, which ends the reads at once."""
        if cluster.as_cluster(self.redis) is not None:
            await self._read_tasks_by_xread()
            return
        keys = list(self._cursors)
        for key in keys:
            await self.redis.xgroup_create(key, BENCH_GROUP, id="0", mkstream=True)
        groups = [keys[i : i + STREAMS_PER_READER] for i in range(0, len(keys), STREAMS_PER_READER)]
        self._readers = [self.redis.connection_pool.make_connection() for _ in groups]
        await asyncio.gather(*(self._read(conn, group) for conn, group in zip(self._readers, groups, strict=True)))

    async def _read(self, conn: aioredis.Connection, keys: list[str]) -> None:
        read = conn.pack_command(
            "XREADGROUP", "GROUP", BENCH_GROUP, "bench", "COUNT", 1000, "NOACK", "BLOCK", READ_BLOCK_MS,
            "STREAMS", *keys, *[">"] * len(keys),
        )  # fmt: skip
        with contextlib.suppress(RedisConnectionError, OSError):  # closed by ``stop``
            while not self.stopped:
                await conn.send_packed_command(read)
                self._arrive(_parsed(await conn.read_response()))

    async def stop(self) -> None:
        self.stopped = True
        for conn in self._readers:
            await conn.disconnect()

    async def _read_tasks_by_xread(self) -> None:
        while not self.stopped:
            reply = cast(TaskReply, await follow.read_reply(self.redis, self._cursors, 1000, 500))
            for key, entries in reply or ():
                self._cursors[key.decode()] = entries[-1][0].decode()
            self._arrive(reply)

    def _arrive(self, reply: TaskReply | None) -> None:
        now = time.time()
        for _, entries in reply or ():
            self.tasks_read += len(entries)
            for _, fields in entries:  # only the id: full decoding would slow the measurement
                self.arrived.setdefault(orjson.loads(fields[b"data"])["request"]["request_id"], now)


def _parsed(raw: Any) -> TaskReply:
    """A raw ``XREADGROUP`` reply (RESP2: nested lists, entries' fields flat) as ``xread`` gives it."""
    return [(key, [(i, dict(zip(f[::2], f[1::2], strict=True))) for i, f in entries]) for key, entries in raw or ()]


def _request(i: int, config: SchedulerBenchConfig) -> GenerateRequest:
    """Request ``i``: a prompt of its own (its first token), as unrelated requests have; one
    prompt for all would be one hot prefix, which cache-aware placement follows (and the index
    then holds every request's chain on the workers it predicted). It carries its hash chain,
    as the API sends it (the scheduler splits it and hashes nothing)."""
    tokens = [32 + i % 200, *[97] * (config.prompt_tokens - 1)]
    return GenerateRequest(
        f"b{i}-{uuid.uuid4().hex[:8]}",
        "tiny",
        tokens,
        SamplingParams(max_tokens=config.max_tokens),
        "bench",
        0,
        prefix_hashes=chain_hex(tokens[:-1], BLOCK_SIZE),
        prefix_block_size=BLOCK_SIZE,
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
    return _paced_result(workers, sent, config, len(sent) / sending_s)


def _paced_result(
    workers: FakeWorkers, sent: dict[str, float], config: SchedulerBenchConfig, achieved_rate: float
) -> dict[str, Any]:
    latency_ms = np.array([(workers.arrived[r] - t) * 1000 for r, t in sent.items() if r in workers.arrived])
    if not latency_ms.size:
        raise SchedulerStalled(f"none of {len(sent)} paced requests was placed within {_placing_s(len(sent)):.0f} s")
    return {
        "requests": len(sent),
        "placed": len(latency_ms),
        "offered_rate": config.rate,
        "achieved_rate": achieved_rate,
        **{f"p{p}_ms": float(np.percentile(latency_ms, p)) for p in (50, 90, 99, 99.9)},
        "max_ms": float(latency_ms.max()),
        "cdf_ms": np.percentile(latency_ms, np.linspace(0, 100, 200)).round(3).tolist(),
    }


async def _flood(
    redis: aioredis.Redis, bus: BusConfig, workers: FakeWorkers, config: SchedulerBenchConfig
) -> dict[str, Any]:
    requests = [_request(i, config) for i in range(config.flood_requests)]
    start = time.time()
    for chunk in range(0, len(requests), 1000):
        pipe = redis.pipeline(transaction=False)
        for request in requests[chunk : chunk + 1000]:
            pipe.xadd(bus.keys.requests, _entry(request)[0])
        await pipe.execute()
    written = time.time()
    sent = dict.fromkeys((r.request_id for r in requests), start)
    await _until(lambda: all(r in workers.arrived for r in sent), _placing_s(len(requests)))
    return {**_flood_result(workers, sent), "write_s": written - start}


def _flood_result(workers: FakeWorkers, sent: dict[str, float]) -> dict[str, Any]:
    """Decisions per second from the first request sent to the last task read."""
    placed = [workers.arrived[r] for r in sent if r in workers.arrived]
    if not placed:
        raise SchedulerStalled(f"none of {len(sent)} flood requests was placed within {_placing_s(len(sent)):.0f} s")
    start = min(sent.values())
    return {
        "requests": len(sent),
        "placed": len(placed),
        "elapsed_s": max(placed) - start,
        "decisions_per_s": len(placed) / (max(placed) - start),
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


@dataclass(frozen=True)
class Setting:
    """One run's setting: who places (``dispatch``), how many of them, over how many workers."""

    dispatch: str
    """``scheduler``: scheduler replicas read the request stream; ``api``: API processes place."""
    count: int
    workers: int


async def _one_setting(url: str, config: SchedulerBenchConfig, setting: Setting, progress: Progress) -> dict[str, Any]:
    bus = BusConfig(redis_url=url, prefix=f"bs{uuid.uuid4().hex[:6]}")
    redis = connect(bus, max_connections=8, name="bench-scheduler")
    workers = FakeWorkers(redis, bus, setting.workers)
    await workers.register()
    background = [asyncio.create_task(workers.keep_alive()), asyncio.create_task(workers.read_tasks())]
    who = f"{setting.count} {'scheduler(s)' if setting.dispatch == 'scheduler' else 'API dispatcher(s)'}"
    try:
        progress(f"{who}, {setting.workers} workers: {config.paced_requests} requests at {config.rate:g}/s")
        if setting.dispatch == "scheduler":
            paced, flood = await _by_schedulers(url, redis, bus, workers, config, setting.count, progress, who)
        else:
            paced, flood = await _by_api_dispatchers(url, bus, workers, config, setting.count, progress, who)
    finally:
        await _stop(workers, background, redis)
    return {
        "dispatch": setting.dispatch,
        "replicas": setting.count,
        "workers": setting.workers,
        "paced": paced,
        "flood": flood,
    }


async def _by_schedulers(
    url: str,
    redis: aioredis.Redis,
    bus: BusConfig,
    workers: FakeWorkers,
    config: SchedulerBenchConfig,
    replicas: int,
    progress: Progress,
    who: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    schedulers = _start_schedulers(url, bus.prefix, replicas)
    try:
        await asyncio.sleep(2.0)  # the schedulers start, create the group and read the registry
        paced = await _paced(redis, bus, workers, config)
        progress(f"{who}: flood of {config.flood_requests} requests")
        return paced, await _flood(redis, bus, workers, config)
    finally:
        for proc in schedulers:
            proc.terminate()
        for proc in schedulers:  # off the event loop: the fake workers beat on while schedulers stop
            await asyncio.to_thread(proc.wait, 30)


async def _by_api_dispatchers(
    url: str,
    bus: BusConfig,
    workers: FakeWorkers,
    config: SchedulerBenchConfig,
    count: int,
    progress: Progress,
    who: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``count`` processes, each an API node's placer with its own registry view, placing its
    share of the paced requests, then of the flood; the sent times come back by a queue."""
    ctx = mp.get_context("spawn")  # not fork: this process runs an event loop
    go, sent = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_dispatcher, args=(url, bus.prefix, config, count, i, go, sent)) for i in range(count)]
    # A deployment that dispatches from the API still runs a scheduler (the reaper, the requests
    # the API cannot place; it settles the cell on the server's run, without which nothing is
    # dispatched): one, idle here.
    schedulers = _start_schedulers(url, bus.prefix, 1)
    await asyncio.sleep(2.0)
    for proc in procs:
        proc.start()
    try:
        await asyncio.to_thread(go.wait, 120)  # set as a dispatcher has read its view and starts
        started, early = time.time(), dict[str, list[dict[str, float]]]()
        paced_sent = await _gather_sent(sent, count, "paced", early)
        rate = len(paced_sent) / max(max(paced_sent.values()) - started, 1e-9)
        await _until(lambda: all(r in workers.arrived for r in paced_sent), _placing_s(len(paced_sent)))
        paced = _paced_result(workers, paced_sent, config, rate)
        progress(f"{who}: flood of {config.flood_requests} requests")
        flood_sent = await _gather_sent(sent, count, "flood", early)
        await _until(lambda: all(r in workers.arrived for r in flood_sent), _placing_s(len(flood_sent)))
        return paced, _flood_result(workers, flood_sent)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        for scheduler in schedulers:
            scheduler.terminate()
            scheduler.wait(30)


async def _gather_sent(
    queue: Any, count: int, phase: str, early: dict[str, list[dict[str, float]]]
) -> dict[str, float]:
    """The sent times of ``phase`` from every dispatcher (one may finish its next phase before
    another finishes this one: those wait in ``early``)."""
    parts = early.pop(phase, [])
    while len(parts) < count:
        got, sent = await asyncio.to_thread(queue.get, True, 600)
        if got == phase:
            parts.append(sent)
        else:
            early.setdefault(got, []).append(sent)
    return {request: at for part in parts for request, at in part.items()}


def _dispatcher(url: str, prefix: str, config: SchedulerBenchConfig, count: int, index: int, go: Any, out: Any) -> None:
    """One API dispatcher process (``multiprocessing`` target)."""
    die_with_parent()
    aio.run(_dispatch_phases(BusConfig(redis_url=url, prefix=prefix), config, count, index, go, out))


async def _dispatch_phases(
    bus: BusConfig, config: SchedulerBenchConfig, count: int, index: int, go: Any, out: Any
) -> None:
    from splitbus.api.placing import ApiPlacer
    from splitbus.bus.registry_view import RegistryView

    redis = connect(bus, max_connections=8, name=f"bench-dispatcher-{index}")
    view = RegistryView(Registry(redis, bus), redis)
    await view.refresh()
    placer = ApiPlacer(redis, bus, view, "splitwise", f"bench-api-{index}")
    following = asyncio.create_task(view.run())
    try:
        go.set()
        rng = np.random.default_rng(config.seed + index)
        gaps = rng.exponential(count / config.rate, config.paced_requests // count)
        sent: dict[str, float] = {}
        start = time.perf_counter()
        for i, at in enumerate(np.cumsum(gaps)):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            request = _request(index * 10**7 + i, config)
            sent[request.request_id] = time.time()
            await placer.place(request)
        out.put(("paced", sent))
        flood = [_request(index * 10**7 + 10**6 + i, config) for i in range(config.flood_requests // count)]
        sent = {}
        for chunk in range(0, len(flood), 256):  # concurrent placements, as an API's requests are
            batch = flood[chunk : chunk + 256]
            now = time.time()
            sent.update((r.request_id, now) for r in batch)
            await asyncio.gather(*(placer.place(r) for r in batch))
        out.put(("flood", sent))
    finally:
        view.stop()
        following.cancel()
        await redis.aclose()


async def _stop(workers: FakeWorkers, background: list[asyncio.Task[None]], redis: aioredis.Redis) -> None:
    """End the fake workers' loops and close the client, each within a bound: the benchmark
    must end even when a loop or the client does not."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(workers.stop(), 5.0)
    _, stuck = await asyncio.wait(background, timeout=5.0)
    for task in stuck:
        task.cancel()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(redis.aclose(), 5.0)


def run_scheduler_bench(url: str, config: SchedulerBenchConfig, progress: Progress) -> dict[str, Any]:
    settings = [
        *[Setting("scheduler", r, w) for w in config.workers for r in config.replicas],
        *[Setting("api", n, w) for w in config.workers for n in config.api_dispatchers],
    ]
    decisions = []
    if config.decisions:
        progress(f"one decision in-process, columns vs rows: {config.decisions} each at {list(config.workers)} workers")
        decisions = measure_decisions(config.workers, config.decisions, config.seed)
    results = [aio.run(_one_setting(url, config, setting, progress)) for setting in settings]
    return {"config": asdict(config), "decisions": decisions, "results": results}
