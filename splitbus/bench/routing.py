"""``splitbus bench routing``: issue 23's targets for the KV index, in three parts.

1. **Scoring latency** (target: p99 <= 1 ms for a 16k-token prompt over 16 workers). A
   ``KvIndex`` where each of ``workers`` workers holds the request's chain to a different depth
   (0 for the first, all of it for the last, evenly between) and ``other_blocks`` unrelated
   blocks, so the maps are as big as a busy cluster's. Each timed request is a fresh
   ``GenerateRequest`` object (a shallow copy of one prompt), so ``IndexPrefixes``' chain memo,
   keyed by the object, does not hide the hashing. Timed with ``time.perf_counter_ns``, the
   garbage collector off in the timed loop: (a) hashing the chain (``IndexPrefixes.chain``),
   (b) ``KvIndex.overlaps`` on it, (c) the whole decision of the ``mixed`` policy with
   ``IndexPrefixes`` over ``workers`` hand-made mixed workers (``policy.place``) for a request
   that carries the chain the API hashed (``prefix_hashes``: the scheduler splits it), the
   target's measure, (d) the same for a request without it (the hashing included: a producer
   other than the API), (e) that decision again, its chain memoized (what a waiting request costs
   on each later loop step). The scheduler's ``routed`` (overlap count and
   prediction) after a decision is not timed.
2. **Event ingest** (target: >= 50k events/s on one core; an event is a ``BlockStored`` or a
   ``BlockRemoved``, as vLLM counts). Each worker's engine step is one batch: a ``BlockRemoved``
   of its 8 oldest blocks, then a ``BlockStored`` of 8 new ones, with consecutive event ids,
   over a cache of ``other_blocks`` blocks. (a) ``KvIndex.apply`` of the batches, already
   decoded, the steps of every worker in turn. (b) through Redis: an embedded Redis; each
   worker's ``KvEventPublisher`` publishes its batches first (not timed), then a
   ``KvIndexFeeder`` with a ``KvEventReader`` on its own client polls (as the scheduler does:
   up to 1000 entries per stream per ``XREAD``) until it has applied them all: XREAD, decoding
   and applying, in this one process (Redis is its own process). The garbage collector stays
   on in both.
3. **Recovery after lost events**: a simulation, ``splitbus.bench.routing_sim`` (its
   docstring says what it models).
"""

from __future__ import annotations

import asyncio
import copy
import gc
import math
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from splitbus.bench.routing_sim import RecoveryConfig, run_recovery
from splitbus.bus.blocks import HEX_FORMAT, chain_hex
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.kv_events import KvEventPublisher, KvEventReader
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.messages.kv_events import BlockRemoved, BlockStored, KvEvent, KvEventBatch, KvSnapshot
from splitbus.bus.records import WorkerLoad, blocks_needed
from splitbus.bus.registry import WorkerInfo, WorkerRecord
from splitbus.bus.roles import Role
from splitbus.placement import policies
from splitbus.placement.decision import Placed
from splitbus.placement.kv_index import KvIndex, KvIndexFeeder
from splitbus.placement.ledger import Local
from splitbus.placement.policies.base import Policy, PolicyOptions
from splitbus.placement.prefixes import IndexPrefixes
from splitbus.redis_server import EmbeddedRedis
from splitbus.scheduler.scheduler import KV_EVENTS_BLOCK_MS

MODEL = "m"
STEP_BLOCKS = 8
"""Blocks a worker's engine step stores, and evicts, in the ingest part."""
SCORING_TARGET_US = 1000.0
INGEST_TARGET_EVENTS_S = 50_000.0
SCORING = ("hash", "overlaps", "place_sent", "place_fresh", "place_memoized")
SCORING_NAMES = {
    "hash": "hash the chain (IndexPrefixes.chain)",
    "overlaps": "KvIndex.overlaps",
    "place_sent": "place (mixed), chain sent by the API",
    "place_fresh": "place (mixed), chain hashed here",
    "place_memoized": "place (mixed), chain memoized",
}
QUICK_RECOVERY = RecoveryConfig(groups=8, rate=20.0, duration_s=9.0, loss_at_s=2.0, loss_s=2.0)


@dataclass(frozen=True)
class RoutingBenchConfig:
    workers: int = 16
    prompt_tokens: int = 16_384
    repeat: int = 3
    """Runs of each scoring and ingest measurement (scoring pools its samples; ingest reports
    the median run)."""
    seed: int = 1
    seeds: int = 10
    """Recovery: seeds simulated (``seed``, ``seed + 1``, ...), pooled."""
    block_size: int = 16
    other_blocks: int = 20_000
    """Blocks each worker holds beside the request's chain (scoring), or in its cache (ingest)."""
    scoring_requests: int = 1000
    """Timed requests per scoring run."""
    warmup: int = 50
    ingest_batches: int = 2000
    """Batches per worker, applied directly."""
    redis_batches: int = 1000
    """Batches per worker, through Redis."""
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    def __post_init__(self) -> None:
        if min(self.workers, self.repeat, self.seeds, self.block_size, self.scoring_requests) < 1:
            raise ValueError("--workers, --repeat, --seeds and the counts must be at least 1")
        if self.prompt_tokens < 2 * self.block_size:
            raise ValueError(f"--prompt-tokens must be at least {2 * self.block_size} (two blocks)")
        if min(self.ingest_batches, self.redis_batches) < 1 or self.other_blocks < STEP_BLOCKS:
            raise ValueError(f"at least one batch per worker and {STEP_BLOCKS} blocks each")
        if self.redis_batches >= 10_000:
            raise ValueError("fewer than 10,000 batches per worker: the streams keep ~10,000")

    @classmethod
    def quick(cls, **options: Any) -> RoutingBenchConfig:
        """Small counts, one run, one short seed: checks that it works."""
        small = {"repeat": 1, "seeds": 1, "other_blocks": 500, "scoring_requests": 20, "warmup": 5}
        counts = {"ingest_batches": 50, "redis_batches": 20, "recovery": QUICK_RECOVERY}
        return cls(**{**small, **counts, **options})


def _hex(worker: int, i: int) -> str:
    """Block ``i`` of ``worker``'s own blocks: a distinct hash of splitbus's width (32 digits)."""
    return format((((worker << 40) + i) * 0x9E3779B97F4A7C15) % 2**128, HEX_FORMAT)


def _percentiles(samples_ns: list[int]) -> dict[str, Any]:
    ordered = sorted(samples_ns)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] / 1000, 1)

    return {"n": len(ordered), "p50_us": at(0.5), "p99_us": at(0.99), "max_us": round(ordered[-1] / 1000, 1)}


# ---------------------------------------------------------------- 1. scoring


def scoring_request(cfg: RoutingBenchConfig) -> GenerateRequest:
    rng = random.Random(cfg.seed)
    tokens = rng.choices(range(32_000), k=cfg.prompt_tokens)
    return GenerateRequest("bench-routing", MODEL, tokens, SamplingParams(max_tokens=16), "api", 0)


def scoring_index(cfg: RoutingBenchConfig, chain: list[str]) -> KvIndex:
    """Worker ``w`` holds the chain's first ``len(chain) * w / (workers - 1)`` blocks and
    ``other_blocks`` of its own."""
    index = KvIndex()
    last = max(cfg.workers - 1, 1)
    for w in range(cfg.workers):
        blocks = chain[: len(chain) * w // last] + [_hex(w, i) for i in range(cfg.other_blocks)]
        index.load(f"w{w}", KvSnapshot(f"w{w}", "bench", 0, "0", blocks))
    return index


def mixed_rows(cfg: RoutingBenchConfig, request: GenerateRequest) -> list[WorkerInfo]:
    """Hand-made mixed workers with varied load, each with room for the request."""
    rng = random.Random(cfg.seed)
    needed = blocks_needed(request, cfg.block_size)
    total = max(8192, 4 * needed)
    rows = []
    for w in range(cfg.workers):
        load = WorkerLoad(
            running=rng.randrange(8),
            queued_prefill_tokens=rng.randrange(cfg.prompt_tokens),
            free_kv_blocks=rng.randrange(2 * needed, total),
            total_kv_blocks=total,
        )
        rows.append(WorkerInfo(WorkerRecord(f"w{w}", Role.MIXED, MODEL, block_size=cfg.block_size, load=load), 0, 3000))
    return rows


@dataclass
class _Scoring:
    prefixes: IndexPrefixes
    policy: Policy
    rows: list[WorkerInfo]
    template: GenerateRequest
    sent: GenerateRequest
    """The template as the API sends it: with its chain (``prefix_hashes``)."""
    block_size: int

    def run(self, count: int, samples: dict[str, list[int]]) -> None:
        """``count`` fresh requests, each timed four ways; the collector off meanwhile."""
        clock, index, size, rows = time.perf_counter_ns, self.prefixes.index, self.block_size, self.rows
        gc.collect()
        gc.disable()
        try:
            for _ in range(count):
                fresh = copy.copy(self.template)
                t0 = clock()
                chain = self.prefixes.chain(fresh, size)
                t1 = clock()
                index.overlaps(chain)
                t2 = clock()
                sent = copy.copy(self.sent)
                t3 = clock()
                self.policy.place(sent, rows, Local())
                t4 = clock()
                other = copy.copy(self.template)
                t5 = clock()
                self.policy.place(other, rows, Local())
                t6 = clock()
                self.policy.place(other, rows, Local())
                t7 = clock()
                for key, ns in zip(SCORING, (t1 - t0, t2 - t1, t4 - t3, t6 - t5, t7 - t6), strict=True):
                    samples[key].append(ns)
        finally:
            gc.enable()


def measure_scoring(cfg: RoutingBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    template = scoring_request(cfg)
    chain = IndexPrefixes(KvIndex()).chain(template, cfg.block_size)
    progress(f"scoring: index of {cfg.workers} workers, {len(chain)}-block chain + {cfg.other_blocks:,} blocks each")
    index = scoring_index(cfg, chain)
    prefixes = IndexPrefixes(index)
    policy = policies.create("mixed", PolicyOptions(rng=random.Random(cfg.seed)), prefixes)
    sent = replace(
        template,
        prefix_hashes=chain_hex(template.prompt_token_ids[:-1], cfg.block_size),
        prefix_block_size=cfg.block_size,
    )
    scoring = _Scoring(prefixes, policy, mixed_rows(cfg, template), template, sent, cfg.block_size)
    decision = policy.place(copy.copy(template), scoring.rows, Local())
    if not isinstance(decision, Placed):
        raise RuntimeError(f"the scoring request was not placed: {decision}")
    chosen = decision.placements[0].worker.record.worker_id
    scoring.run(cfg.warmup, {key: [] for key in SCORING})
    samples: dict[str, list[int]] = {key: [] for key in SCORING}
    for run in range(cfg.repeat):
        progress(f"scoring: run {run + 1}/{cfg.repeat}, {cfg.scoring_requests} fresh requests")
        scoring.run(cfg.scoring_requests, samples)
    results = {key: _percentiles(samples[key]) for key in SCORING}
    return {
        "prompt_tokens": cfg.prompt_tokens,
        "chain_blocks": len(chain),
        "workers": cfg.workers,
        "other_blocks_per_worker": cfg.other_blocks,
        "index_blocks": sum(index.blocks(w) for w in index.workers()),
        "depths": [index.overlap(w, chain) for w in index.workers()],
        "decision": {"worker": chosen, "overlap_blocks": index.overlap(chosen, chain)},
        "gc_disabled_in_timed_loop": True,
        "results": results,
        "target_us": SCORING_TARGET_US,
        "target_measure": "place_sent",
        "target_met": results["place_sent"]["p99_us"] <= SCORING_TARGET_US,
    }


# ---------------------------------------------------------------- 2. ingest


def step_events(worker: int, k: int, cached: int, block_size: int) -> list[KvEvent]:
    """Worker ``worker``'s step ``k`` (from 0) over a cache of ``cached`` blocks: it evicts its
    ``STEP_BLOCKS`` oldest, then stores as many new ones (a chain run)."""
    new = cached + STEP_BLOCKS * k
    removed = BlockRemoved([_hex(worker, STEP_BLOCKS * k + j) for j in range(STEP_BLOCKS)])
    stored = BlockStored([_hex(worker, new + j) for j in range(STEP_BLOCKS)], _hex(worker, new - 1), block_size)
    return [removed, stored]


def _rates(batches: int, events: int, hashes: int, seconds: float, cpu_s: float | None = None) -> dict[str, Any]:
    rates = {
        "batches": batches,
        "events": events,
        "hashes": hashes,
        "seconds": round(seconds, 4),
        "batches_per_s": round(batches / seconds),
        "events_per_s": round(events / seconds),
        "hashes_per_s": round(hashes / seconds),
    }
    if cpu_s is not None:
        rates["process_cpu_s"] = round(cpu_s, 4)
    return rates


def ingest_pure(cfg: RoutingBenchConfig) -> dict[str, Any]:
    """``KvIndex.apply`` of every worker's batches, a step of each worker in turn."""
    index = KvIndex()
    for w in range(cfg.workers):
        blocks = [_hex(w, i) for i in range(cfg.other_blocks)]
        index.load(f"w{w}", KvSnapshot(f"w{w}", "bench", 0, "0", blocks))
    work = [
        (
            f"w{w}",
            f"{k + 1}-0",
            KvEventBatch(f"w{w}", "bench", k + 1, step_events(w, k, cfg.other_blocks, cfg.block_size)),
        )
        for k in range(cfg.ingest_batches)
        for w in range(cfg.workers)
    ]
    apply = index.apply
    start = time.perf_counter()
    statuses = [apply(worker, entry, batch) for worker, entry, batch in work]
    seconds = time.perf_counter() - start
    if set(statuses) != {"applied"}:
        raise RuntimeError(f"a batch was not applied: {sorted(set(statuses))}")
    if any(index.blocks(w) != cfg.other_blocks for w in index.workers()):
        raise RuntimeError("the index does not hold what the batches describe")
    return _rates(len(work), 2 * len(work), 2 * STEP_BLOCKS * len(work), seconds)


async def _publish_all(publisher: KvEventPublisher, steps: list[list[KvEvent]]) -> None:
    for events in steps:
        await publisher.publish(events)


async def _feed(feeder: KvIndexFeeder, alive: list[str], expected: int) -> int:
    """Poll until ``expected`` entries are read; returns the polls."""
    read = polls = 0
    while read < expected:
        got = await feeder.poll(alive, block_ms=KV_EVENTS_BLOCK_MS)  # as the scheduler polls
        if got == 0:
            raise RuntimeError(f"the feeder read {read} of {expected} batches, then nothing")
        read, polls = read + got, polls + 1
    return polls


def _check_index(index: KvIndex, publishers: list[KvEventPublisher]) -> None:
    """Every worker's cache is in the index, whole, with no resync pending."""
    for publisher in publishers:
        if index.needs_resync(publisher.worker_id) or index.blocks(publisher.worker_id) != len(publisher.cached):
            raise RuntimeError(f"the index does not hold {publisher.worker_id}'s cache")


async def _ingest_redis(
    publishing: aioredis.Redis, reading: aioredis.Redis, bus: BusConfig, cfg: RoutingBenchConfig
) -> dict[str, Any]:
    alive = [f"w{w}" for w in range(cfg.workers)]
    publishers = [KvEventPublisher(publishing, bus, worker) for worker in alive]
    for publisher in publishers:
        await publisher.start()  # event 1 (a fresh cache) and a first snapshot
    cached = [[_hex(w, i) for i in range(cfg.other_blocks)] for w in range(cfg.workers)]
    await asyncio.gather(*(p.publish([BlockStored(blocks)]) for p, blocks in zip(publishers, cached, strict=True)))
    index = KvIndex()
    feeder = KvIndexFeeder(index, KvEventReader(reading, bus))
    await feeder.poll(alive)  # resyncs every worker from its snapshot, reads its cache's batch
    steps = [
        [step_events(w, k, cfg.other_blocks, cfg.block_size) for k in range(cfg.redis_batches)]
        for w in range(cfg.workers)
    ]
    await asyncio.gather(*(_publish_all(p, s) for p, s in zip(publishers, steps, strict=True)))
    expected = cfg.workers * cfg.redis_batches
    start, cpu = time.perf_counter(), time.process_time()
    polls = await _feed(feeder, alive, expected)
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    _check_index(index, publishers)
    rates = _rates(expected, 2 * expected, 2 * STEP_BLOCKS * expected, seconds, cpu_s)
    return {**rates, "polls": polls}


async def _redis_run(url: str, cfg: RoutingBenchConfig) -> dict[str, Any]:
    bus = BusConfig(redis_url=url, prefix=f"br{uuid.uuid4().hex[:8]}")
    publishing = connect(bus, name="bench-routing-publishers")
    reading = connect(bus, max_connections=2, name="bench-routing-feeder")
    try:
        return await _ingest_redis(publishing, reading, bus, cfg)
    finally:
        await publishing.aclose()
        await reading.aclose()


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    median = statistics.median_low([r["events_per_s"] for r in runs])
    chosen = next(r for r in runs if r["events_per_s"] == median)
    return {**chosen, "runs_events_per_s": [r["events_per_s"] for r in runs]}


def measure_ingest(cfg: RoutingBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    pure = []
    for run in range(cfg.repeat):
        progress(f"ingest: KvIndex.apply, {cfg.workers} workers x {cfg.ingest_batches} batches, run {run + 1}")
        pure.append(ingest_pure(cfg))
    redis_runs = []
    with (
        tempfile.TemporaryDirectory(prefix="splitbus-bench-") as data,
        EmbeddedRedis(Path(data), appendonly=False) as server,
    ):
        for run in range(cfg.repeat):
            progress(
                f"ingest: through Redis, {cfg.workers} workers x {cfg.redis_batches} batches published, then "
                f"read by a KvIndexFeeder (the publishing not timed), run {run + 1}"
            )
            redis_runs.append(asyncio.run(_redis_run(server.url, cfg)))
    results = {"apply": _median_run(pure), "redis": _median_run(redis_runs)}
    return {
        "workers": cfg.workers,
        "cached_blocks_per_worker": cfg.other_blocks,
        "event": f"one BlockRemoved or BlockStored of {STEP_BLOCKS} hashes; a batch (engine step) holds one of each",
        "redis_timing": "XREAD + decode + apply in this process, after every batch was published (not timed)",
        "results": results,
        "target_events_per_s": INGEST_TARGET_EVENTS_S,
        "target_met": {name: r["events_per_s"] >= INGEST_TARGET_EVENTS_S for name, r in results.items()},
    }


# ---------------------------------------------------------------- all three


def run_routing_bench(cfg: RoutingBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    load_start = os.getloadavg()
    scoring = measure_scoring(cfg, progress)
    ingest = measure_ingest(cfg, progress)
    seeds = list(range(cfg.seed, cfg.seed + cfg.seeds))
    recovery = run_recovery(replace(cfg.recovery, block_size=cfg.block_size), seeds, progress)
    return {
        "config": {k: v for k, v in asdict(cfg).items() if k != "recovery"},
        "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
        "scoring": scoring,
        "ingest": ingest,
        "recovery": recovery,
    }
