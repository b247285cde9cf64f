"""``splitbus bench bus``: Redis Streams against a ZeroMQ asyncio PUSH/PULL baseline, same payloads.

Two paths, each measured flat out (messages/s) and paced (publish->read latency):

- request path: API-like producer tasks XADD requests; a scheduler-like group consumer reads them
  with XREADGROUP and acks them. Baseline: PUSH/PULL of the same encoded entries.
- token path: 1000 concurrent requests; an engine-like producer writes one pipelined XADD per
  request per step through ``ResultWriter``; an API-like process follows all 1000 result streams
  with the multiplexed ``ResultReader`` and one task per request. Baseline: one PUSH message per
  token, routed by request id into the same per-request ordering (``Subscription``).

Producer, consumer (and Redis) are separate processes. Publish times are wall-clock µs, which
every process on one machine shares.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import redis

from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.core.streams import GroupConsumer, Producer
from splitbus.bus.messages import GenerateRequest, SamplingParams, TokenDelta
from splitbus.bus.results import ResultReader, ResultWriter, Subscription, shard_name
from splitbus.redis_server import free_port

GROUP = "bench"


@dataclass(frozen=True)
class BusBenchConfig:
    requests: int = 20_000
    """Request-path messages sent flat out."""
    request_producers: int = 16
    """Concurrent producer tasks (an API process serving many clients)."""
    paced_requests: int = 2_000
    paced_request_rate: float = 2_000.0
    streams: int = 1_000
    """Concurrent result streams on the token path."""
    steps: int = 40
    """Engine steps sent flat out on the token path (one token per stream per step)."""
    paced_steps: int = 40
    paced_step_interval_s: float = 0.05
    """1000 streams every 50 ms = 20k tokens/s."""
    prompt_tokens: int = 64
    repeat: int = 3

    def __post_init__(self) -> None:
        if min(self.requests, self.request_producers, self.paced_requests, self.streams, self.steps) < 1:
            raise ValueError("counts must be >= 1")
        if self.repeat < 1 or self.paced_request_rate <= 0 or self.paced_step_interval_s <= 0:
            raise ValueError("repeat >= 1 and rates > 0")


@dataclass(frozen=True)
class Measurement:
    messages: int
    seconds: float
    latencies_us: list[int]

    @property
    def msgs_per_s(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_us:
            return float("nan")
        ordered = sorted(self.latencies_us)
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


# ---------------------------------------------------------------- payloads


def request_message(i: int, prompt_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"bench-{i}",
        model="bench",
        prompt_token_ids=list(range(prompt_tokens)),
        sampling=SamplingParams(max_tokens=128, temperature=0.0),
        api_node="api-bench",
        deadline_ms=0,
    )


BENCH_READER = "bench-api"
"""The token consumer's result reader (one shard): the producer writes into its slot."""


def request_id(i: int) -> str:
    return f"tok-{i}"


# ---------------------------------------------------------------- process plumbing


def _in_process(fn: Callable[..., Any], conn: Any, *args: Any) -> None:
    """Child-process entry: run one async role, send its result (or error) to the parent."""
    try:
        import uvloop

        run: Callable[..., Any] = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        conn.send(("ok", run(fn(conn, *args))))
    except BaseException as exc:  # report it, the parent must not hang
        conn.send(("error", repr(exc)))
        raise


def run_pair(
    consumer: Callable[..., Any], producer: Callable[..., Any], *args: Any, timeout_s: float = 60
) -> Measurement:
    """Start the consumer, wait until it is ready, start the producer, collect both."""
    ctx = mp.get_context("spawn")
    c_parent, c_child = ctx.Pipe()
    p_parent, p_child = ctx.Pipe()
    cons = ctx.Process(target=_in_process, args=(consumer, c_child, *args), daemon=True)
    prod = ctx.Process(target=_in_process, args=(producer, p_child, *args), daemon=True)
    cons.start()
    try:
        _expect(c_parent, "ready", timeout_s)
        prod.start()
        start_us = _expect(p_parent, None, timeout_s)
        count, last_us, latencies = _expect(c_parent, None, timeout_s)
    finally:
        for proc in (cons, prod):
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return Measurement(count, (last_us - start_us) / 1e6, latencies)


def _expect(conn: Any, want: Any, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError("benchmark process did not answer in time")
    status, value = conn.recv()
    if status == "error":
        raise RuntimeError(f"benchmark process failed: {value}")
    if want is not None and value != want:
        raise RuntimeError(f"expected {want!r}, got {value!r}")
    return value


async def _pace(i: int, start: float, rate: float | None) -> None:
    if rate:
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


async def _send_concurrently(n: int, tasks: int, rate: float | None, send: Callable[[int], Awaitable[None]]) -> int:
    """Send messages 0..n-1 from ``tasks`` concurrent tasks (as an API process with many
    clients does), paced at ``rate`` per second if given. Returns the start time (µs)."""
    start_us, start = codec.now_us(), time.perf_counter()

    async def run(worker: int) -> None:
        for i in range(worker, n, tasks):
            await _pace(i, start, rate)
            await send(i)

    await asyncio.gather(*(run(w) for w in range(tasks)))
    return start_us


def _bus_config(url: str, prefix: str) -> BusConfig:
    return BusConfig(redis_url=url, prefix=prefix, block_ms=100)


# ---------------------------------------------------------------- request path


async def redis_request_consumer(
    conn: Any, target: str, prefix: str, n: int, rate: float | None, cfg: BusBenchConfig
) -> tuple:
    config = _bus_config(target, prefix)
    redis = connect(config)
    consumer = GroupConsumer(redis, config, config.keys.requests, GROUP, "c1")
    await consumer.ensure_group("$")
    conn.send(("ok", "ready"))
    latencies: list[int] = []
    while len(latencies) < n:
        batch = await consumer.read(256)
        now = codec.now_us()
        latencies.extend(now - (d.published_us or now) for d in batch)
        await consumer.ack(*[d.entry_id for d in batch])
    await redis.aclose()
    return n, codec.now_us(), latencies


async def redis_request_producer(
    conn: Any, target: str, prefix: str, n: int, rate: float | None, cfg: BusBenchConfig
) -> int:
    config = _bus_config(target, prefix)
    redis = connect(config, max_connections=cfg.request_producers + 1)
    producer = Producer(redis, config)
    messages = [request_message(i, cfg.prompt_tokens) for i in range(n)]

    async def send(i: int) -> None:
        await producer.send(config.keys.requests, messages[i])

    start_us = await _send_concurrently(n, cfg.request_producers, rate, send)
    await redis.aclose()
    return start_us


async def zmq_request_consumer(
    conn: Any, target: str, prefix: str, n: int, rate: float | None, cfg: BusBenchConfig
) -> tuple:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(target)
    conn.send(("ok", "ready"))
    latencies: list[int] = []
    for _ in range(n):
        type_, data, ts = await sock.recv_multipart()
        fields = {b"type": type_, b"data": data, b"ts": ts}
        codec.decode(fields)  # the same decoding work as the Redis consumer
        latencies.append(codec.now_us() - int(ts))
    last = codec.now_us()
    sock.close(linger=0)
    ctx.term()
    return n, last, latencies


async def zmq_request_producer(
    conn: Any, target: str, prefix: str, n: int, rate: float | None, cfg: BusBenchConfig
) -> int:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(target)
    messages = [request_message(i, cfg.prompt_tokens) for i in range(n)]

    async def send(i: int) -> None:
        f = codec.encode(messages[i])
        await sock.send_multipart([f[b"type"], f[b"data"], f[b"ts"]])

    start_us = await _send_concurrently(n, cfg.request_producers, rate, send)
    sock.close(linger=5000)
    ctx.term()
    return start_us


# ---------------------------------------------------------------- token path


async def _drain_subscriptions(subs: list[Subscription], steps: int) -> tuple:
    """One task per request, as an API process has: count tokens and their latency."""
    latencies: list[int] = []

    async def follow(sub: Subscription) -> None:
        for _ in range(steps):
            result = await sub.get()
            if not isinstance(result, TokenDelta):  # the producer sends tokens only, never an end
                raise RuntimeError(f"the benchmark's token stream ended early: {result!r}")
            latencies.append(codec.now_us() - int(result.text))

    await asyncio.gather(*(follow(s) for s in subs))
    return len(latencies), codec.now_us(), latencies


async def redis_token_consumer(
    conn: Any, target: str, prefix: str, steps: int, interval: float | None, cfg: BusBenchConfig
) -> tuple:
    config = _bus_config(target, prefix)
    redis = connect(config, max_connections=2)
    reader = ResultReader(config, redis, name=BENCH_READER)
    await reader.start()
    subs = [await reader.subscribe(request_id(i)) for i in range(cfg.streams)]
    conn.send(("ok", "ready"))
    result = await _drain_subscriptions(subs, steps)
    await reader.close()
    await redis.aclose()
    return result


async def redis_token_producer(
    conn: Any, target: str, prefix: str, steps: int, interval: float | None, cfg: BusBenchConfig
) -> int:
    config = _bus_config(target, prefix)
    redis = connect(config)
    writer = ResultWriter(redis, config)
    for i in range(cfg.streams):
        writer.open(request_id(i), reader=shard_name(BENCH_READER, 0))
    start_us, start = codec.now_us(), time.perf_counter()
    for step in range(steps):
        await _pace(step, start, 1 / interval if interval else None)
        stamp = str(codec.now_us())  # the token's text carries its step time
        for i in range(cfg.streams):
            writer.tokens(request_id(i), [step], stamp)
        await writer.flush()
    await redis.aclose()
    return start_us


async def zmq_token_consumer(
    conn: Any, target: str, prefix: str, steps: int, interval: float | None, cfg: BusBenchConfig
) -> tuple:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(target)
    subs = {request_id(i).encode(): Subscription(request_id(i), request_id(i)) for i in range(cfg.streams)}
    conn.send(("ok", "ready"))

    async def route() -> None:
        for _ in range(steps * cfg.streams):
            rid, type_, data, ts = await sock.recv_multipart()
            result = codec.decode({b"type": type_, b"data": data, b"ts": ts})
            assert isinstance(result, TokenDelta)  # the bench sends token entries only
            subs[rid].accept(result)

    router = asyncio.create_task(route())
    result = await _drain_subscriptions(list(subs.values()), steps)
    await router
    sock.close(linger=0)
    ctx.term()
    return result


async def zmq_token_producer(
    conn: Any, target: str, prefix: str, steps: int, interval: float | None, cfg: BusBenchConfig
) -> int:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(target)
    rids = [request_id(i).encode() for i in range(cfg.streams)]
    start_us, start = codec.now_us(), time.perf_counter()
    for step in range(steps):
        await _pace(step, start, 1 / interval if interval else None)
        stamp = str(codec.now_us())
        for seq_rid in rids:
            f = codec.encode(TokenDelta(step, [step], stamp))
            await sock.send_multipart([seq_rid, f[b"type"], f[b"data"], f[b"ts"]])
    sock.close(linger=5000)
    ctx.term()
    return start_us


# ---------------------------------------------------------------- orchestration


ROLES = {
    ("request", "redis"): (redis_request_consumer, redis_request_producer),
    ("request", "zeromq"): (zmq_request_consumer, zmq_request_producer),
    ("token", "redis"): (redis_token_consumer, redis_token_producer),
    ("token", "zeromq"): (zmq_token_consumer, zmq_token_producer),
}


def measure(path: str, transport: str, redis_url: str, prefix: str, cfg: BusBenchConfig, paced: bool) -> Measurement:
    consumer, producer = ROLES[(path, transport)]
    target = redis_url if transport == "redis" else f"tcp://127.0.0.1:{free_port()}"
    if path == "request":
        n, pace = (cfg.paced_requests, cfg.paced_request_rate) if paced else (cfg.requests, None)
    else:
        n, pace = (cfg.paced_steps, cfg.paced_step_interval_s) if paced else (cfg.steps, None)
    return run_pair(consumer, producer, target, prefix, n, pace, cfg)


def summarize(flat: list[Measurement], paced: list[Measurement]) -> dict[str, float | list[float]]:
    return {
        "msgs_per_s": round(statistics.median(m.msgs_per_s for m in flat), 1),
        "p50_us": round(statistics.median(m.percentile(0.50) for m in paced), 1),
        "p99_us": round(statistics.median(m.percentile(0.99) for m in paced), 1),
        "flat_out_p50_us": round(statistics.median(m.percentile(0.50) for m in flat), 1),
        "runs_msgs_per_s": [round(m.msgs_per_s, 1) for m in flat],
    }


def run_bus_bench(redis_url: str, cfg: BusBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every measurement, side by side; keys live under a fresh prefix, deleted at the end."""
    report: dict[str, Any] = {"config": asdict(cfg)}
    base = f"bench-{uuid.uuid4().hex[:8]}"
    for path in ("request", "token"):
        section: dict[str, Any] = {}
        for transport in ("redis", "zeromq"):
            flat, paced = [], []
            for r in range(cfg.repeat):
                progress(f"{path} path, {transport}: run {r + 1}/{cfg.repeat}")
                flat.append(measure(path, transport, redis_url, f"{base}-{path}-{r}f", cfg, paced=False))
                paced.append(measure(path, transport, redis_url, f"{base}-{path}-{r}p", cfg, paced=True))
            section[transport] = summarize(flat, paced)
        section["ratio"] = round(section["redis"]["msgs_per_s"] / section["zeromq"]["msgs_per_s"], 3)
        report[f"{path}_path"] = section
    delete_prefix(redis_url, base)
    return report


def delete_prefix(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        for batch in _batched(client.scan_iter(match=f"{prefix}*", count=1000), 500):
            client.delete(*batch)
    finally:
        client.close()


def _batched(items: Iterable[Any], size: int) -> Iterable[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
