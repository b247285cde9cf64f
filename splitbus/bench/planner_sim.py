"""``bench planner``'s fleet: a discrete-event simulation of prefill and decode workers, in
simulated time (no Redis, no sleeping, deterministic per seed).

The model and its assumptions:

- **A prefill worker** takes its queue first in, first out, in batches of up to
  ``max_prefill_tokens`` uncached tokens (at least one request); a batch lasts
  ``prefill_batch_s + prefill_s_per_token * uncached tokens``. Its prefix cache has no bound: a
  prompt that shares a prefix finds it cached on a worker that prefilled that prefix before.
  The first token is out when the batch ends; the worker then ships each request's KV
  (``prompt * kv_bytes_per_token / transfer_bytes_per_s``) and holds it until the transfer ends.
- **A decode worker** reserves a request's blocks (prompt + output) when the request is placed,
  as a decode worker does when it reads its task; the request joins the batch at the first step
  after its KV arrived; a step of ``b`` requests lasts ``decode_step_s + decode_s_per_seq * b``
  and gives each one token; steps follow each other while any request runs.
- **Placement** is the scheduler's rule at arrival: the prefill worker with the fewest queued
  prefill tokens, the decode worker with the most free KV blocks (then the fewest requests),
  both among workers that are up and not draining. A request no decode worker has room for is
  held, first in first out, until one has; with no worker of a role up it is refused.
- **Workers** start ``start_delay_s`` after they are asked for and are paid from the ask. A
  draining worker takes nothing new, finishes what it holds, then leaves (paid until then).
  The fleet changes only through a ``Controller`` called every ``interval_s`` with what the
  registry would show (each worker's heartbeat, a ``WorkerLoad`` of the counters it keeps); its
  advice (counts and reasons) is acted on as ``up --autoscale`` acts on the planner's, by the
  same rule (``splitbus.cli.autoscale.reconcile``): workers start at once for a rise; a fall the
  planner measured drains one worker per role at a time, only one serving and asked for
  ``START_GRACE_S`` ago, the one holding least first.

Every request ends exactly once, finished or refused; the run counts any that did not (lost)
or ended twice (duplicated), so a drain that dropped one would show.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from splitbus.bus.records import WorkerLoad
from splitbus.bus.roles import Role
from splitbus.placement.costs import choose
from splitbus.planner.autoscale import (
    MAX_WORKERS,
    SCALED,
    START_GRACE_S,
    Advice,
    Bounds,
    Drain,
    Roster,
    Start,
    reconcile,
)


@dataclass(frozen=True)
class SimCosts:
    """The costs of one model on one accelerator, per worker.

    ``H100_8B`` is the preset: an 8B dense model (Llama-3.1-8B's shape: 32 layers, 8 KV heads of
    128) in bf16 on one H100 SXM. Its KV size is arithmetic; its prefill and decode costs, the
    transfer bandwidth and the start delay are ASSUMPTIONS, each with its basis in the field's
    note, not measurements."""

    prefill_batch_s: float = 0.010
    """a_p, a prefill batch's fixed cost. Assumed: launch and scheduling overhead of a forward."""
    prefill_s_per_token: float = 0.00005
    """c_p, per uncached prompt token. Assumed: 20 000 tokens/s, from 16 GFLOP a token (2 x 8e9
    parameters) at about 320 TFLOP/s, a third of the H100's dense bf16 peak."""
    decode_step_s: float = 0.007
    """a_d, a decode step's fixed cost. Assumed: reading 16 GB of weights at 3.35 TB/s takes
    4.8 ms; the rest is overhead."""
    decode_s_per_seq: float = 0.00006
    """c_d, per request in the step. Assumed: reading a 1 300-token context's KV (170 MB at 128
    KiB a token) at 3.35 TB/s takes 0.05 ms, plus its share of compute."""
    kv_bytes_per_token: int = 32 * 8 * 128 * 2 * 2
    """Arithmetic: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 128 KiB."""
    transfer_bytes_per_s: float = 25e9
    """P to D. Assumed: one 200 Gb/s RDMA link, less protocol overhead."""
    kv_blocks: int = 24_000
    """A decode worker's KV blocks. Arithmetic on an assumed budget: 90 % of 80 GiB less 16 GB
    of weights and about 4 GB of activations, in 2 MiB blocks (16 tokens of 128 KiB)."""
    block_size: int = 16
    max_prefill_tokens: int = 8192
    """A prefill batch's uncached tokens at most (a worker's ``--max-prefill-tokens``)."""
    max_decode_batch: int = 512
    """Requests in a decode step at most; the rest wait for a place."""
    start_delay_s: float = 30.0
    """From the ask to serving. Assumed: loading 16 GB of weights from local NVMe and capturing
    CUDA graphs."""

    def __post_init__(self) -> None:
        costs = (self.prefill_batch_s, self.prefill_s_per_token, self.decode_step_s, self.decode_s_per_seq)
        if min(costs) < 0 or self.start_delay_s < 0 or self.transfer_bytes_per_s <= 0:
            raise ValueError("costs and the start delay must be >= 0, the transfer bandwidth > 0")
        sizes = (self.kv_bytes_per_token, self.kv_blocks, self.block_size, self.max_prefill_tokens)
        if min(sizes) < 1 or self.max_decode_batch < 1:
            raise ValueError("KV sizes, blocks and batch bounds must be >= 1")

    def prefill_s(self, uncached_tokens: float) -> float:
        return self.prefill_batch_s + self.prefill_s_per_token * uncached_tokens

    def decode_s(self, batch: int) -> float:
        return self.decode_step_s + self.decode_s_per_seq * batch

    def transfer_s(self, prompt_tokens: int) -> float:
        return prompt_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s


H100_8B = SimCosts()


@dataclass(frozen=True)
class TraceConfig:
    """The trace: Poisson arrivals in three equal phases at ``rate``, ``peak`` x ``rate``,
    ``rate``; the share of long prompts moves linearly from ``long_from`` to ``long_to``."""

    rate: float = 20.0
    """λ0, arrivals per second of the first and last phases."""
    peak: float = 3.0
    phase_s: float = 300.0
    short_tokens: int = 256
    long_tokens: int = 2048
    long_from: float = 0.2
    long_to: float = 0.8
    shared: float = 0.3
    """Share of requests whose prompt starts with one of ``prefix_groups`` shared prefixes."""
    prefix_groups: int = 8
    prefix_share: float = 0.75
    """A shared prefix's part of its prompt."""
    output_mean: float = 128.0
    output_sigma: float = 1.0
    """Lognormal outputs: the log's standard deviation (the mean is ``output_mean``)."""
    max_output: int = 2048

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.peak <= 0 or self.phase_s <= 0 or self.output_mean < 1:
            raise ValueError("rate, peak, phase length and the mean output must be positive")
        shares = (self.long_from, self.long_to, self.shared, self.prefix_share)
        if min(shares) < 0 or max(shares) > 1:
            raise ValueError("shares are between 0 and 1")
        if min(self.short_tokens, self.long_tokens, self.prefix_groups, self.max_output) < 1:
            raise ValueError("prompt lengths, prefix groups and the output bound must be >= 1")

    @property
    def duration_s(self) -> float:
        return 3 * self.phase_s

    def rate_at(self, t: float) -> float:
        return self.rate * (self.peak if self.phase_s <= t < 2 * self.phase_s else 1.0)

    def mean_rate(self) -> float:
        return self.rate * (2 + self.peak) / 3


@dataclass(frozen=True)
class TraceRequest:
    rid: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix: tuple[int, int] | None
    """(group, prompt length) of a shared prefix, None for a prompt of its own."""
    prefix_tokens: int


def trace(cfg: TraceConfig, seed: int) -> list[TraceRequest]:
    """The seeded arrivals, in time order."""
    rng = np.random.default_rng(seed)
    arrivals = [t for k in range(3) for t in _phase(rng, cfg, k)]
    mu = math.log(cfg.output_mean) - cfg.output_sigma**2 / 2  # the lognormal's mean is then output_mean
    outputs = np.clip(np.rint(rng.lognormal(mu, cfg.output_sigma, len(arrivals))), 1, cfg.max_output)
    return [_request(rng, cfg, i, t, int(o)) for i, (t, o) in enumerate(zip(arrivals, outputs, strict=True))]


def _phase(rng: np.random.Generator, cfg: TraceConfig, k: int) -> list[float]:
    start = k * cfg.phase_s
    count = rng.poisson(cfg.rate_at(start) * cfg.phase_s)
    return [float(t) for t in np.sort(rng.uniform(start, start + cfg.phase_s, count))]


def _request(rng: np.random.Generator, cfg: TraceConfig, rid: int, at: float, output: int) -> TraceRequest:
    long_share = cfg.long_from + (cfg.long_to - cfg.long_from) * at / cfg.duration_s
    prompt = cfg.long_tokens if rng.random() < long_share else cfg.short_tokens
    if rng.random() >= cfg.shared:
        return TraceRequest(rid, at, prompt, output, None, 0)
    group = int(rng.integers(cfg.prefix_groups))
    return TraceRequest(rid, at, prompt, output, (group, prompt), int(prompt * cfg.prefix_share))


@dataclass
class Counters:
    """What a worker's heartbeat carries, by ``WorkerLoad``'s names and meanings (the fields a
    dense solo worker fills). Mutable, as every event moves one: ``load`` is the heartbeat."""

    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    prefills_done: int = 0
    decodes_done: int = 0
    prompt_tokens_done: int = 0
    prompt_tokens_cached: int = 0
    prefill_busy_us: int = 0
    decode_tokens_done: int = 0
    decode_steps: int = 0
    decode_time_us: int = 0
    draining: int = 0

    def load(self) -> WorkerLoad:
        return WorkerLoad(**vars(self))


@dataclass
class Request:
    """A request's path through the fleet."""

    trace: TraceRequest
    blocks: int
    cached: int = 0
    prefill: _Prefill | None = None
    decode: _Decode | None = None
    first_token_at: float | None = None
    kv_at: float | None = None
    done_at: float | None = None
    ends: int = 0
    refused: bool = False

    @property
    def uncached(self) -> int:
        return self.trace.prompt_tokens - self.cached

    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.trace.arrival_s

    def itl_s(self) -> float | None:
        """Mean time between tokens after the first (the KV hand-off's wait included)."""
        if self.done_at is None or self.first_token_at is None:
            return None
        return (self.done_at - self.first_token_at) / max(self.trace.output_tokens - 1, 1)


@dataclass
class _Worker:
    wid: str
    role: Role
    asked_at: float
    ready_at: float
    left_at: float | None = None
    draining: bool = False
    counters: Counters = field(default_factory=Counters)

    def up(self, now: float) -> bool:
        return self.ready_at <= now and self.left_at is None

    def placeable(self, now: float) -> bool:
        return self.up(now) and not self.draining

    def paid_s(self, end: float) -> float:
        return (self.left_at if self.left_at is not None else end) - self.asked_at


@dataclass
class _Prefill(_Worker):
    queue: deque[Request] = field(default_factory=deque)
    batch: list[Request] = field(default_factory=list)
    handing_off: int = 0
    cache: set[tuple[int, int]] = field(default_factory=set)

    def holds(self) -> bool:
        return bool(self.queue or self.batch or self.handing_off)

    def queued_tokens(self) -> int:
        return self.counters.queued_prefill_tokens


@dataclass
class _Decode(_Worker):
    awaiting: int = 0
    ready: deque[Request] = field(default_factory=deque)
    running: dict[int, Request] = field(default_factory=dict)
    ends_at_step: list[tuple[int, int]] = field(default_factory=list)
    """(step its last token comes at, request id): a heap."""
    steps: int = 0
    stepping: bool = False

    def holds(self) -> bool:
        return bool(self.awaiting or self.ready or self.running)

    def free(self) -> int:
        return self.counters.free_kv_blocks


@dataclass(frozen=True)
class Registry:
    """What a controller sees at a tick: every worker that is up (draining ones included)."""

    at_s: float
    workers: tuple[tuple[str, Role, WorkerLoad], ...]
    held: int
    """Requests no decode worker had room for, waiting to be placed."""


Controller = Callable[[Registry], Advice | None]
"""Called every interval: the advice (each role's count and its reason, as the planner publishes
them), or None to leave the fleet."""

UNBOUNDED = Bounds(1, MAX_WORKERS)
"""A fleet's bounds when none are given: ``up --autoscale``'s widest."""


@dataclass(frozen=True)
class Sample:
    """The fleet at one tick."""

    t_s: float
    arrivals_rps: float
    prefill: int
    decode: int
    """Up and not draining."""
    starting: tuple[int, int]
    draining: tuple[int, int]
    desired: tuple[int, int] | None


@dataclass
class Run:
    """One run's requests, workers and samples."""

    requests: list[Request]
    workers: list[_Worker]
    samples: list[Sample]
    end_s: float

    def worker_seconds(self, role: Role | None = None) -> float:
        """Paid seconds of every worker, or of ``role``'s."""
        return sum(w.paid_s(self.end_s) for w in self.workers if role in (None, w.role))


class FleetSim:
    """One fleet on one trace. ``fleet``: the (prefill, decode) workers up at time 0."""

    def __init__(
        self,
        costs: SimCosts,
        fleet: tuple[int, int],
        controller: Controller | None = None,
        interval_s: float = 5.0,
        bounds: Bounds = UNBOUNDED,
        seed: int = 0,
    ) -> None:
        self.costs, self.controller, self.interval_s, self.bounds = costs, controller, interval_s, bounds
        self.rng = random.Random(seed)
        self.now = 0.0
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.workers: list[_Worker] = []
        self.held: deque[Request] = deque()
        self.samples: list[Sample] = []
        self._arrived = 0
        for role, count in zip((Role.PREFILL, Role.DECODE), fleet, strict=True):
            for _ in range(count):
                self._add(role, ready_at=0.0)

    # ------------------------------------------------------------ the loop

    def run(self, requests: list[TraceRequest]) -> Run:
        reqs = [Request(t, math.ceil((t.prompt_tokens + t.output_tokens) / self.costs.block_size)) for t in requests]
        for req in reqs:
            self._at(req.trace.arrival_s, functools.partial(self._arrive, req))
        horizon = max((t.arrival_s for t in requests), default=0.0)
        self._at(self.interval_s, lambda: self._tick(horizon))
        while self.events:
            self.now, _, act = heapq.heappop(self.events)
            act()
        end = max([horizon, *(r.done_at or 0.0 for r in reqs)])
        return Run(reqs, self.workers, self.samples, end)

    def _at(self, when: float, act: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, act))

    def _tick(self, horizon: float) -> None:
        """Ask the controller, act as ``up --autoscale`` would, sample the fleet; again until the
        trace and the work are over."""
        advice = self.controller(self._registry()) if self.controller is not None else None
        rosters: dict[str, Roster[_Worker]] = {role: self._roster(role) for role in SCALED}
        for action in reconcile(advice, rosters, self.bounds):
            self._act(action)
        desired = None if advice is None else (advice.desired_prefill, advice.desired_decode)
        self.samples.append(self._sample(desired))
        if self.now < horizon or self._busy():
            self._at(self.now + self.interval_s, lambda: self._tick(horizon))

    def _busy(self) -> bool:
        return bool(self.held) or any(w.left_at is None and _holds(w) for w in self.workers)

    # ------------------------------------------------------------ the fleet

    def _add(self, role: Role, ready_at: float) -> _Worker:
        wid = f"{role.value[0]}{sum(w.role == role for w in self.workers)}"
        worker: _Worker
        if role == Role.PREFILL:
            worker = _Prefill(wid, role, self.now, ready_at)
        else:
            worker = _Decode(wid, role, self.now, ready_at)
        worker.counters.total_kv_blocks = worker.counters.free_kv_blocks = self.costs.kv_blocks
        self.workers.append(worker)
        if ready_at > self.now:
            self._at(ready_at, lambda: self._ready(worker))
        return worker

    def _ready(self, worker: _Worker) -> None:
        if worker.left_at is None and worker.role == Role.DECODE:
            self._place_held()

    def _of(self, role: Role) -> Iterator[_Worker]:
        return (w for w in self.workers if w.role == role and w.left_at is None and not w.draining)

    def _roster(self, role: Role) -> Roster[_Worker]:
        """The role's workers as ``up``'s autoscaler sees its own (``Autoscaler.roster``): running
        (not draining, those starting included); of them the drainable, serving (a worker registers
        once it serves) and asked for ``START_GRACE_S`` ago, the one holding least first; and the
        draining ones."""
        running = list(self._of(role))
        aged = [w for w in running if w.up(self.now) and self.now - w.asked_at >= START_GRACE_S]
        draining = sum(w.draining for w in self.workers if w.role == role and w.left_at is None)
        return Roster(len(running), sorted(aged, key=_held), draining)

    def _act(self, action: Start | Drain[_Worker]) -> None:
        if isinstance(action, Drain):
            self._drain(action.child)
        else:
            self._add(Role(action.role), self.now + self.costs.start_delay_s)

    def _drain(self, worker: _Worker) -> None:
        worker.draining = True
        worker.counters.draining = 1
        self._leave_if_done(worker)

    def _leave_if_done(self, worker: _Worker) -> None:
        if worker.draining and worker.left_at is None and not _holds(worker):
            worker.left_at = self.now

    def _registry(self) -> Registry:
        up = tuple((w.wid, w.role, w.counters.load()) for w in self.workers if w.up(self.now))
        return Registry(self.now, up, len(self.held))

    def _sample(self, desired: tuple[int, int] | None) -> Sample:
        arrived, self._arrived = self._arrived, 0
        serving = self._count(lambda w: w.placeable(self.now))
        starting = self._count(lambda w: not w.up(self.now))
        draining = self._count(lambda w: w.draining)
        return Sample(self.now, arrived / self.interval_s, *serving, starting, draining, desired)

    def _count(self, which: Callable[[_Worker], bool]) -> tuple[int, int]:
        """(prefill, decode) workers not gone that ``which`` picks."""
        live = [w for w in self.workers if w.left_at is None and which(w)]
        return sum(w.role == Role.PREFILL for w in live), sum(w.role == Role.DECODE for w in live)

    # ------------------------------------------------------------ requests

    def _arrive(self, req: Request) -> None:
        self._arrived += 1
        if not any(w.placeable(self.now) for w in self._of(Role.PREFILL)) or not any(
            w.placeable(self.now) for w in self._of(Role.DECODE)
        ):
            req.refused = True
            req.ends += 1
            return
        self.held.append(req)
        self._place_held()

    def _place_held(self) -> None:
        while self.held and self._place(self.held[0]):
            self.held.popleft()

    def _place(self, req: Request) -> bool:
        decode = self._decode_worker(req)
        prefill = choose([w for w in self._of(Role.PREFILL) if w.placeable(self.now)], _load, self.rng)
        if decode is None or prefill is None:
            return False
        assert isinstance(prefill, _Prefill)
        self._reserve(decode, req)
        self._enqueue(prefill, req)
        return True

    def _decode_worker(self, req: Request) -> _Decode | None:
        room = [w for w in self._of(Role.DECODE) if w.placeable(self.now) and _free(w) >= req.blocks]
        most = choose(room, lambda w: -_free(w), self.rng)
        if most is None:
            return None
        tied = [w for w in room if _free(w) >= _free(most) * 0.95]  # the policy's NEAR, on blocks
        found = choose(tied, _load, self.rng)
        assert isinstance(found, _Decode)
        return found

    def _reserve(self, decode: _Decode, req: Request) -> None:
        req.decode = decode
        decode.awaiting += 1
        decode.counters.waiting += 1
        decode.counters.free_kv_blocks -= req.blocks

    def _enqueue(self, prefill: _Prefill, req: Request) -> None:
        req.prefill = prefill
        req.cached = req.trace.prefix_tokens if req.trace.prefix in prefill.cache else 0
        prefill.queue.append(req)
        prefill.counters.waiting += 1
        prefill.counters.queued_prefill_tokens += req.uncached
        if not prefill.batch:
            self._prefill(prefill)

    # ------------------------------------------------------------ prefill

    def _prefill(self, worker: _Prefill) -> None:
        batch: list[Request] = []
        tokens = 0
        c = worker.counters
        while worker.queue and (not batch or tokens + worker.queue[0].uncached <= self.costs.max_prefill_tokens):
            req = worker.queue.popleft()
            c.queued_prefill_tokens -= req.uncached  # as counted when it was queued
            req.cached = req.trace.prefix_tokens if req.trace.prefix in worker.cache else 0  # cached since?
            batch.append(req)
            tokens += req.uncached
        worker.batch = batch
        c.waiting -= len(batch)
        c.running = len(batch) + worker.handing_off
        duration = self.costs.prefill_s(tokens)
        self._at(self.now + duration, lambda: self._prefilled(worker, duration))

    def _prefilled(self, worker: _Prefill, duration: float) -> None:
        c = worker.counters
        c.prefill_busy_us += round(duration * 1e6)
        for req in worker.batch:
            req.first_token_at = self.now
            c.prefills_done += 1
            c.prompt_tokens_done += req.trace.prompt_tokens
            c.prompt_tokens_cached += req.cached
            if req.trace.prefix is not None:
                worker.cache.add(req.trace.prefix)
            self._hand_off(worker, req)
        worker.batch = []
        c.running = worker.handing_off
        if worker.queue:
            self._prefill(worker)
        self._leave_if_done(worker)

    def _hand_off(self, worker: _Prefill, req: Request) -> None:
        if req.trace.output_tokens <= 1:  # it ends on P: D gives its blocks back unused
            self._finish(req)
            self._release(req)
            return
        worker.handing_off += 1
        self._at(self.now + self.costs.transfer_s(req.trace.prompt_tokens), lambda: self._transferred(worker, req))

    def _transferred(self, worker: _Prefill, req: Request) -> None:
        worker.handing_off -= 1
        worker.counters.running = len(worker.batch) + worker.handing_off
        self._leave_if_done(worker)
        decode = req.decode
        assert decode is not None
        req.kv_at = self.now
        decode.awaiting -= 1
        decode.counters.waiting -= 1
        decode.ready.append(req)
        if not decode.stepping:
            self._step(decode)

    # ------------------------------------------------------------ decode

    def _step(self, worker: _Decode) -> None:
        while worker.ready and len(worker.running) < self.costs.max_decode_batch:
            req = worker.ready.popleft()
            worker.running[req.trace.rid] = req
            heapq.heappush(worker.ends_at_step, (worker.steps + req.trace.output_tokens - 1, req.trace.rid))
        if not worker.running:
            worker.stepping = False
            return
        worker.stepping = True
        worker.counters.running = len(worker.running)
        duration = self.costs.decode_s(len(worker.running))
        self._at(self.now + duration, lambda: self._stepped(worker, duration))

    def _stepped(self, worker: _Decode, duration: float) -> None:
        worker.steps += 1
        c = worker.counters
        c.decode_steps += 1
        c.decode_tokens_done += len(worker.running)
        c.decode_time_us += round(duration * 1e6)
        while worker.ends_at_step and worker.ends_at_step[0][0] <= worker.steps:
            _, rid = heapq.heappop(worker.ends_at_step)
            req = worker.running.pop(rid)
            c.decodes_done += 1
            self._finish(req)
            self._release(req)
        c.running = len(worker.running)
        self._step(worker)
        self._leave_if_done(worker)

    def _finish(self, req: Request) -> None:
        req.done_at = self.now
        req.ends += 1

    def _release(self, req: Request) -> None:
        decode = req.decode
        assert decode is not None
        decode.counters.free_kv_blocks += req.blocks
        if req.trace.output_tokens <= 1:
            decode.awaiting -= 1
            decode.counters.waiting -= 1
            self._leave_if_done(decode)
        self._place_held()


def _holds(worker: _Worker) -> bool:
    return worker.holds() if isinstance(worker, (_Prefill, _Decode)) else False


def _load(worker: _Worker) -> float:
    """The placement cost: queued prefill tokens on P, requests held on D."""
    c = worker.counters
    return c.queued_prefill_tokens if worker.role == Role.PREFILL else c.running + c.waiting


def _held(worker: _Worker) -> int:
    """What a worker holds as ``worker_standings`` reads it: its heartbeat's running + waiting."""
    return worker.counters.running + worker.counters.waiting


def _free(worker: _Worker) -> int:
    return worker.counters.free_kv_blocks
