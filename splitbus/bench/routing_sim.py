"""``bench routing``'s recovery part: a discrete-event simulation of cache-aware routing when a
scheduler replica loses KV events, in simulated time (no Redis, no sleeping, deterministic).

What is real: each worker's cache is a ``BlockPool`` (``splitbus.worker.engines.prefix``), each
request is placed by the ``mixed`` policy with ``IndexPrefixes`` over a ``KvIndex``
(``splitbus.scheduler``), which is fed the pools' own events as ``KvEventBatch``es and resynced
from a ``KvSnapshot``, as a ``KvIndexFeeder`` does. The hit ratio is what the pools found cached.

The model and its assumptions:

- **Workload**: ``groups`` shared prefixes of ``prefix_tokens`` random tokens, each request one
  prefix (chosen uniformly) and ``question_tokens`` random tokens of its own; Poisson arrivals at
  ``rate`` per second, all seeded.
- **A worker**: a request allocates its blocks (prompt + ``output_tokens``) when it is placed,
  its prompt's full blocks are registered at once (the prefill is taken as instant), and it holds
  its blocks for ``service_s``, then releases them (no decode is modelled: only block holding).
  A pool has room for the blocks its share of the running requests holds on average, plus a cache
  room sized so that the prefixes need ``cache_share`` workers' rooms (``pool_blocks``).
- **The registry**: every decision sees each worker's exact load (free blocks, running
  requests; no queued prefill: placing is immediate), as if the snapshot were never stale, so
  no local reservations are needed. A request that finds no worker with room waits, in order,
  until a request ends.
- **The events**: each placement is one engine step: the events it made (an eviction, a store)
  go out as one batch with the worker's next event id and reach the index at once (no bus
  delay). Between ``loss_at_s`` and ``loss_at_s + loss_s`` the batches of the ``lost`` workers
  (``all``, or ``one``: the first) are lost: their ids are used but the index never sees them.
- **The resync**: the first batch after the loss makes ``KvIndex.apply`` answer ``gap``; the
  worker's snapshot (its publisher's set of cached blocks, folded from every batch it sent, this
  one included) is loaded at once, as the feeder's next poll would (its polling delay, and the
  wait for a fresh snapshot when a stream was trimmed, are not modelled).
- **Predictions**: the scheduler's ``routed`` predicts each placed chain on its worker for
  ``PREDICT_S`` of simulated time, and they expire as in the scheduler.

The same seed is run with and without the loss; the hit ratio (prompt tokens found cached at
allocation, ``Allocation.cached_tokens``, over prompt tokens, by allocation time) is compared
after the resync (the last lost worker's).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from splitbus.bus.kv_events import fold
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.messages.kv_events import AllBlocksCleared, KvEvent, KvEventBatch, KvSnapshot
from splitbus.bus.records import WorkerLoad, blocks_needed
from splitbus.bus.registry import WorkerInfo, WorkerRecord
from splitbus.bus.roles import Role
from splitbus.placement import policies
from splitbus.placement.decision import Placed
from splitbus.placement.kv_index import KvIndex
from splitbus.placement.ledger import Local
from splitbus.placement.policies.base import PolicyOptions
from splitbus.placement.prefixes import IndexPrefixes
from splitbus.worker.engines.prefix import BlockPool

MODEL = "m"
VOCAB = 32_000
Hits = list[tuple[float, int, int]]
"""(allocation time, cached prompt tokens, prompt tokens) of each request of a run."""


@dataclass(frozen=True)
class RecoveryConfig:
    workers: int = 8
    groups: int = 30
    prefix_tokens: int = 1500
    question_tokens: int = 300
    output_tokens: int = 16
    """Only sizes each request's blocks (``max_tokens``)."""
    rate: float = 40.0
    """Arrivals per second (Poisson)."""
    service_s: float = 1.0
    """How long a request holds its blocks."""
    duration_s: float = 25.0
    loss_at_s: float = 10.0
    loss_s: float = 5.0
    lost: str = "all"
    """Whose batches are lost: ``all`` workers', or ``one`` (the first worker's)."""
    cache_share: float = 6.0
    """The prefixes need about this many workers' cache rooms."""
    block_size: int = 16
    bucket_s: float = 0.5
    target_points: float = 2.0
    """The target: 1 s after the resync, the hit ratio within this many points of the run without loss."""

    def __post_init__(self) -> None:
        if self.workers < 1 or self.groups < 1 or self.rate <= 0 or self.service_s <= 0 or self.block_size < 1:
            raise ValueError("workers, groups, rate, service time and block size must be positive")
        if self.lost not in ("all", "one"):
            raise ValueError("lost is 'all' or 'one'")
        if not 0 <= self.loss_at_s < self.loss_at_s + self.loss_s < self.duration_s:
            raise ValueError("the loss must start and end within the run")

    def request_blocks(self) -> int:
        return math.ceil((self.prefix_tokens + self.question_tokens + self.output_tokens) / self.block_size)

    def pool_blocks(self) -> int:
        """Room for a worker's mean share of the running requests, plus its cache room: the
        prefixes' blocks over ``cache_share``."""
        running = math.ceil(self.rate * self.service_s / self.workers)
        prefixes = self.groups * math.ceil(self.prefix_tokens / self.block_size)
        return running * self.request_blocks() + math.ceil(prefixes / self.cache_share)


def workload(cfg: RecoveryConfig, seed: int) -> list[tuple[float, GenerateRequest]]:
    """The seeded arrivals: (time, request), in time order."""
    rng = random.Random(seed)
    vocab = range(VOCAB)
    prefixes = [rng.choices(vocab, k=cfg.prefix_tokens) for _ in range(cfg.groups)]
    sampling = SamplingParams(max_tokens=cfg.output_tokens)
    arrivals: list[tuple[float, GenerateRequest]] = []
    t = rng.expovariate(cfg.rate)
    while t < cfg.duration_s:
        prompt = prefixes[rng.randrange(cfg.groups)] + rng.choices(vocab, k=cfg.question_tokens)
        arrivals.append((t, GenerateRequest(f"r{len(arrivals)}", MODEL, prompt, sampling, "api", 0)))
        t += rng.expovariate(cfg.rate)
    return arrivals


@dataclass
class _Worker:
    """A simulated worker: its pool, and its publisher's event ids and set of cached blocks."""

    wid: str
    pool: BlockPool
    running: int = 0
    event_id: int = 0
    cached: set[str] = field(default_factory=set)
    lost_batches: int = 0
    gap_at: float | None = None
    resync_at: float | None = None

    def row(self) -> WorkerInfo:
        load = WorkerLoad(running=self.running, free_kv_blocks=self.pool.free, total_kv_blocks=self.pool.total)
        record = WorkerRecord(self.wid, Role.MIXED, MODEL, block_size=self.pool.block_size, load=load)
        return WorkerInfo(record, 0, 3000)


@dataclass(order=True)
class _Departure:
    at: float
    seq: int
    worker: _Worker = field(compare=False)
    table: list[int] = field(compare=False)


class RecoverySim:
    """One run: the workers, the index and the policy, in simulated time."""

    def __init__(self, cfg: RecoveryConfig, seed: int, lose: bool) -> None:
        self.cfg, self.lose = cfg, lose
        self.now = 0.0
        self.index = KvIndex(clock=lambda: self.now)
        self.prefixes = IndexPrefixes(self.index)
        self.policy = policies.create("mixed", PolicyOptions(rng=random.Random(seed)), self.prefixes)
        size = cfg.pool_blocks()
        self.workers = [_Worker(f"w{i}", BlockPool(range(size), cfg.block_size)) for i in range(cfg.workers)]
        self.by_id = {w.wid: w for w in self.workers}
        self.lost = {w.wid for w in self.workers} if cfg.lost == "all" else {self.workers[0].wid}
        self.waiting: deque[GenerateRequest] = deque()
        self.departures: list[_Departure] = []
        self.hits: Hits = []
        self.statuses: dict[str, int] = {}
        self._seq = 0

    def run(self, arrivals: list[tuple[float, GenerateRequest]]) -> None:
        for w in self.workers:  # each publisher's start: an empty cache, event 1
            self._send(w, [AllBlocksCleared()])
        for at, request in arrivals:
            self._depart_until(at)
            self.now = at
            self.index.expire()
            self.waiting.append(request)
            self._place_waiting()
        self._depart_until(math.inf)

    def _depart_until(self, until: float) -> None:
        while self.departures and self.departures[0].at <= until:
            done = heapq.heappop(self.departures)
            self.now = done.at
            done.worker.pool.release(done.table)
            done.worker.running -= 1
            self._place_waiting()

    def _place_waiting(self) -> None:
        while self.waiting and self._place(self.waiting[0]):
            self.waiting.popleft()

    def _place(self, request: GenerateRequest) -> bool:
        rows = [w.row() for w in self.workers]
        decision = self.policy.place(request, rows, Local())
        if not isinstance(decision, Placed):
            return False
        row = decision.placements[0].worker
        worker = self.by_id[row.record.worker_id]
        prompt = request.prompt_token_ids
        allocation = worker.pool.allocate(blocks_needed(request, self.cfg.block_size), prompt)
        if allocation is None:
            return False
        self.prefixes.routed(request, row)
        worker.pool.store(allocation.table, prompt)
        self.hits.append((self.now, allocation.cached_tokens, len(prompt)))
        worker.running += 1
        self._seq += 1
        heapq.heappush(self.departures, _Departure(self.now + self.cfg.service_s, self._seq, worker, allocation.table))
        events = worker.pool.events.pending()
        worker.pool.events.sent(len(events))
        self._send(worker, events)
        return True

    def _losing(self, worker: _Worker) -> bool:
        start = self.cfg.loss_at_s
        return self.lose and worker.wid in self.lost and start <= self.now < start + self.cfg.loss_s

    def _send(self, worker: _Worker, events: list[KvEvent]) -> None:
        """The worker's publisher sends this step's events as one batch; the index applies it,
        unless it is lost, and resyncs from the snapshot at a gap."""
        if not events:
            return
        worker.event_id += 1
        fold(worker.cached, events)
        if self._losing(worker):
            worker.lost_batches += 1
            return
        entry = f"{worker.event_id}-0"
        status = self.index.apply(worker.wid, entry, KvEventBatch(worker.wid, "sim", worker.event_id, events))
        self._count(status)
        if status == "gap":
            worker.gap_at = self.now
            snapshot = KvSnapshot(worker.wid, "sim", worker.event_id, entry, sorted(worker.cached))
            self._count(self.index.load(worker.wid, snapshot))
            worker.resync_at = self.now

    def _count(self, status: str) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


def _sums(hits: Hits, start: float, end: float) -> tuple[int, int]:
    """Cached prompt tokens and prompt tokens of the requests allocated in [start, end)."""
    chosen = [(c, p) for t, c, p in hits if start <= t < end]
    return sum(c for c, _ in chosen), sum(p for _, p in chosen)


def _ratio(cached: int, prompt: int) -> float | None:
    return round(cached / prompt, 4) if prompt else None


def _pooled(runs: list[Hits], spans: list[tuple[float, float]]) -> float | None:
    """The hit ratio of several runs' requests together, each run's in its own [start, end)."""
    sums = [_sums(hits, start, end) for hits, (start, end) in zip(runs, spans, strict=True)]
    return _ratio(sum(c for c, _ in sums), sum(p for _, p in sums))


def series(runs: list[Hits], bucket_s: float, duration_s: float) -> list[dict[str, Any]]:
    """The hit ratio per bucket of allocation time, the runs (one per seed) pooled."""
    out = []
    for k in range(math.ceil(duration_s / bucket_s)):
        start = k * bucket_s
        requests = sum(1 for hits in runs for t, _, _ in hits if start <= t < start + bucket_s)
        out.append(
            {
                "t_s": round(start, 3),
                "requests": requests,
                "hit_ratio": _pooled(runs, [(start, start + bucket_s)] * len(runs)),
            }
        )
    return out


def ideal_hit_ratio(cfg: RecoveryConfig, arrivals: list[tuple[float, GenerateRequest]]) -> float | None:
    """Every request but its group's first finds its prefix's full blocks cached."""
    seen: set[tuple[int, ...]] = set()
    cached = prompt = 0
    for _, request in arrivals:
        key = tuple(request.prompt_token_ids[: cfg.prefix_tokens])
        cached += (cfg.prefix_tokens // cfg.block_size) * cfg.block_size if key in seen else 0
        prompt += len(request.prompt_token_ids)
        seen.add(key)
    return _ratio(cached, prompt)


@dataclass
class _Pair:
    """One seed's two runs."""

    seed: int
    requests: int
    base: RecoverySim
    lossy: RecoverySim

    def lost(self) -> list[_Worker]:
        return [w for w in self.lossy.workers if w.wid in self.lossy.lost]

    def resync(self, cfg: RecoveryConfig) -> float:
        """When the last lost worker was resynced (the loss's end if one never was)."""
        return max((w.resync_at for w in self.lost() if w.resync_at is not None), default=cfg.loss_at_s + cfg.loss_s)


def _pair(cfg: RecoveryConfig, seed: int, progress: Callable[[str], None]) -> _Pair:
    arrivals = workload(cfg, seed)
    progress(f"recovery, seed {seed}: {len(arrivals)} requests over {cfg.duration_s:g} s, with and without the loss")
    base, lossy = RecoverySim(cfg, seed, False), RecoverySim(cfg, seed, True)
    base.run(arrivals)
    lossy.run(arrivals)
    return _Pair(seed, len(arrivals), base, lossy)


TARGET_WINDOW = "1s_to_2s"
"""The window the target is judged on: the second that starts 1 s after the resync."""


def _windows(cfg: RecoveryConfig, resync: float) -> dict[str, tuple[float, float]]:
    """The windows compared, by allocation time; those after the resync relative to each seed's."""
    return {
        "before_loss": (0.0, cfg.loss_at_s),
        "during_loss": (cfg.loss_at_s, cfg.loss_at_s + cfg.loss_s),
        "resync_to_1s": (resync, resync + 1.0),
        "1s_to_2s": (resync + 1.0, resync + 2.0),
        "1s_to_end": (resync + 1.0, math.inf),  # to the last request placed
    }


def _window(cfg: RecoveryConfig, pairs: list[_Pair], name: str) -> dict[str, Any]:
    """One window, the seeds pooled, and the spread of the seeds' differences."""
    spans = [_windows(cfg, pair.resync(cfg))[name] for pair in pairs]
    a = _pooled([pair.base.hits for pair in pairs], spans)
    b = _pooled([pair.lossy.hits for pair in pairs], spans)
    diffs = [
        _points(_pooled([p.base.hits], [span]), _pooled([p.lossy.hits], [span]))
        for p, span in zip(pairs, spans, strict=True)
    ]
    stderr = _stderr([d for d in diffs if d is not None])
    requests = sum(_placed_in(pair.lossy.hits, span) for pair, span in zip(pairs, spans, strict=True))
    return {
        "without_loss": a,
        "with_loss": b,
        "points_lower": _points(a, b),
        "points_lower_stderr": None if stderr is None else round(stderr, 2),
        "points_lower_by_seed": diffs,
        "requests_with_loss": requests,
    }


def _stderr(values: list[float]) -> float | None:
    """The standard error of the mean; None for fewer than two values."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def _placed_in(hits: Hits, span: tuple[float, float]) -> int:
    """How many of the requests were placed in ``span``."""
    return sum(1 for t, _, _ in hits if span[0] <= t < span[1])


def _points(a: float | None, b: float | None) -> float | None:
    """How many points ``b`` is below ``a``."""
    return None if a is None or b is None else round(100 * (a - b), 2)


def _seed_row(cfg: RecoveryConfig, pair: _Pair) -> dict[str, Any]:
    lost = pair.lost()
    return {
        "seed": pair.seed,
        "requests": pair.requests,
        "lost_batches": sum(w.lost_batches for w in lost),
        "gap_at_s": {w.wid: None if w.gap_at is None else round(w.gap_at, 4) for w in lost},
        "resync_s": round(pair.resync(cfg), 4),
        "resynced": all(w.resync_at is not None for w in lost),
        "index_statuses": pair.lossy.statuses,
    }


def run_recovery(cfg: RecoveryConfig, seeds: list[int], progress: Callable[[str], None]) -> dict[str, Any]:
    """Both runs of each seed, and their comparison, the seeds pooled."""
    pairs = [_pair(cfg, seed, progress) for seed in seeds]
    windows = {name: _window(cfg, pairs, name) for name in _windows(cfg, 0.0)}
    verdict = windows[TARGET_WINDOW]["points_lower"]
    rows = [_seed_row(cfg, pair) for pair in pairs]
    resynced = all(row["resynced"] for row in rows)
    return {
        "config": {**asdict(cfg), "pool_blocks": cfg.pool_blocks(), "request_blocks": cfg.request_blocks()},
        "seeds": rows,
        "ideal_hit_ratio": ideal_hit_ratio(cfg, workload(cfg, seeds[0])),
        "windows": windows,
        "runs": {
            name: {
                "hit_ratio": _pooled(runs, [(0.0, math.inf)] * len(runs)),
                "series": series(runs, cfg.bucket_s, cfg.duration_s),
            }
            for name, runs in (
                ("without_loss", [p.base.hits for p in pairs]),
                ("with_loss", [p.lossy.hits for p in pairs]),
            )
        },
        "target_points": cfg.target_points,
        "target_window": TARGET_WINDOW,
        "target_met": resynced and verdict is not None and abs(verdict) <= cfg.target_points,
    }
