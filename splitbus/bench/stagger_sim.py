"""Discrete-event simulation of one DP group under the real scheduling code.

Placement is the scheduler's (naive: each arrival at once to a rank among those with the fewest
queued prefill tokens, chosen by ``choose`` as ``Policy`` does; staggered: the ``StaggerWindow``'s
batches, spread by ``water_fill``), and every step each rank acts by ``decide`` on the group's
plans, exactly as a ``DpStepper`` does. Step costs are the sim engine's model (``SimConfig``): the
group's step lasts as long as its slowest rank's compute plus EP's all-to-all
(``SimConfig.group_step_s``), which ``NO_EP``, the default, leaves out.

Time advances a step at a time, and the arrivals of a step are handled at its end: ranks take
work only there, so placing an arrival earlier would change nothing, and a stagger window, which
closes just before the step ends, closes there. (A window that closed in the middle of a step
could not be modelled this way: it took the processes to show that the first window rule, half a
step, lost what this model credited it with.) Idle forwards and step times are counted over the
steps that start by the last arrival.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from splitbus.placement.costs import choose
from splitbus.placement.stagger import Job, RankLoad, StaggerWindow, water_fill
from splitbus.worker.dp import StepPlan, decide
from splitbus.worker.engines.sim import SimConfig

NO_EP = SimConfig(a2a_s=0.0, a2a_s_per_token=0.0)
"""The sim engine's costs without the all-to-all: what ``bench stagger`` measured its published
tables with (docs/benchmarks.md); pass ``SimConfig()`` for the EP cost model."""
PREFILL_TOKEN_BUDGET = 4096
KV_BLOCKS_PER_RANK = 8192
BLOCK = 16


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def poisson_trace(rate_per_s: float, duration_s: float, seed: int) -> list[TraceRequest]:
    """Seeded Poisson arrivals; prompts of 64-1024 tokens, outputs of 16-128."""
    rng = np.random.default_rng(seed)
    count = rng.poisson(rate_per_s * duration_s)
    arrivals = np.sort(rng.uniform(0, duration_s, count))
    prompts = rng.integers(64, 1025, count)
    outputs = rng.integers(16, 129, count)
    return [TraceRequest(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs, strict=True)]


@dataclass
class _Req:
    trace: TraceRequest
    queued_at: float = 0.0
    remaining: int = 0
    batch_id: str = ""
    batch_ranks: int = 0
    ttft_s: float | None = None
    done_at: float | None = None


class GroupFull(Exception):
    """A request fits on no rank: the trace asks for more KV than the simulated group has."""

    def __init__(self, req: _Req) -> None:
        super().__init__(
            f"no rank has KV room for a {req.trace.prompt_tokens}+{req.trace.output_tokens}-token request; shorten the "
            "trace"
        )


@dataclass
class _Rank:
    name: str
    queued: list[_Req] = field(default_factory=list)
    running: list[_Req] = field(default_factory=list)

    def load(self) -> RankLoad:
        queued = sum(r.trace.prompt_tokens for r in self.queued)
        held = sum(
            math.ceil((r.trace.prompt_tokens + r.trace.output_tokens) / BLOCK) for r in self.queued + self.running
        )
        return RankLoad(self.name, queued, KV_BLOCKS_PER_RANK - held)


@dataclass(frozen=True)
class SimResult:
    idle_forward_ratio: float
    """Idle forwards per rank-step."""
    idle_forward_ratio_all_steps: float
    """The same, the drain after the last arrival included."""
    idle_time_ratio: float
    """Share of the ranks' time spent in idle forwards (a step lasts as long as its slowest rank)."""
    step_utilization: float
    """Share of the ranks' time spent computing their own prefill or decode."""
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tok_s: float
    requests: int


class GroupSimulation:
    def __init__(
        self,
        ranks: int,
        staggered: bool,
        max_wait_s: float = 0.05,
        align_ms: float = 20.0,
        costs: SimConfig | None = None,
        seed: int = 0,
    ) -> None:
        self.ranks = [_Rank(f"r{i}") for i in range(ranks)]
        self.window: StaggerWindow[_Req] | None = StaggerWindow(max_wait_s) if staggered else None
        self.align_ms = align_ms if staggered else 0.0
        self.costs = costs or NO_EP
        self.now = 0.0
        self.step_ends = 0.0
        """When the running step ends (the last one, while the group is idle): what the ranks
        announce, and where a stagger window closes."""
        self.arrivals_end = 0.0
        """The trace's last arrival: the counters cover the steps that start by then. After it
        the group drains the last requests' decodes, with fewer and fewer ranks busy, which a
        group under steady load never does; in a 6 s trace that is about half of the steps, and
        it would swamp the rest."""
        self.rank_steps = self.idle_steps = 0
        self.all_rank_steps = self.all_idle_steps = 0
        self.batches = 0
        self.rank_time_s = self.idle_time_s = self.busy_time_s = 0.0
        self.idle_compute_s = 0.0
        """The ranks' compute in idle forwards (each costs ``forward_s("idle")``), over the
        counted steps: what EP's lock-step wastes, where ``idle_time_s`` is the time the idle
        ranks spent in those steps, waiting for the others included."""
        self.rng = random.Random(seed)

    def run(self, trace: list[TraceRequest]) -> SimResult:
        requests = [_Req(t) for t in trace]
        self.arrivals_end = max((t.arrival_s for t in trace), default=0.0)
        upcoming = list(requests)
        while upcoming or self._busy():
            upcoming = self._arrive(upcoming)
            if self._busy():
                self._step()
            else:
                self.now = self._next_event(upcoming)
        return self._result(requests)

    def _busy(self) -> bool:
        return any(r.queued or r.running for r in self.ranks) or bool(self.window and self.window.held)

    def _arrive(self, upcoming: list[_Req]) -> list[_Req]:
        while upcoming and upcoming[0].trace.arrival_s <= self.now:
            req = upcoming.pop(0)
            if self.window is None:
                self._place_naive(req)
                continue
            self._close_window(req.trace.arrival_s)  # it closed before this arrival, in the step
            if self.window.opened_at is None:
                self.window.open(req.trace.arrival_s, self.step_ends)  # no dispatch delay to allow for here
            self.window.add(req, req.trace.arrival_s)
        self._close_window(self.now)
        return upcoming

    def _close_window(self, at: float) -> None:
        """Place the window's batch if it closed by ``at``. A window that closed in the middle of
        the step (its bound, ``max_wait_s``, came before the step's end) is placed on the loads the
        step started from, as the processes place it: ranks take work only at the step's end."""
        if self.window is not None and self.window.ready(at):
            self._place_batch(self.window.release())

    def _place_naive(self, req: _Req) -> None:
        blocks = math.ceil((req.trace.prompt_tokens + req.trace.output_tokens) / BLOCK)
        loads = {rank.name: rank.load() for rank in self.ranks}
        roomy = [rank for rank in self.ranks if loads[rank.name].free_blocks >= blocks]
        rank = choose(roomy, lambda r: loads[r.name].queued_tokens, self.rng)
        if rank is None:
            raise GroupFull(req)
        req.queued_at = self.now
        rank.queued.append(req)

    def _place_batch(self, batch: list[_Req]) -> None:
        by_key = {f"{r.trace.arrival_s:.9f}/{i}": r for i, r in enumerate(batch)}
        jobs = [
            Job(k, r.trace.prompt_tokens, math.ceil((r.trace.prompt_tokens + r.trace.output_tokens) / BLOCK))
            for k, r in by_key.items()
        ]
        placed = water_fill(jobs, [rank.load() for rank in self.ranks])
        if len(placed) < len(jobs):
            raise GroupFull(next(r for k, r in by_key.items() if k not in placed))
        names = {rank.name: rank for rank in self.ranks}
        self.batches += 1
        for key, rank in placed.items():
            req = by_key[key]
            req.queued_at = self.now
            req.batch_id, req.batch_ranks = str(self.batches), len(set(placed.values()))
            names[rank].queued.append(req)

    def _next_event(self, upcoming: list[_Req]) -> float:
        events = [upcoming[0].trace.arrival_s] if upcoming else []
        if self.window is not None and self.window.due_at() is not None:
            events.append(self.window.due_at() or 0.0)
        return max(self.now, min(events)) if events else self.now

    def _step(self) -> None:
        plans = [self._plan(i, r) for i, r in enumerate(self.ranks)]
        actions = [decide(p, plans, self.align_ms) for p in plans]
        if all(a == "none" for a in actions):  # only the window holds work: wait for it
            self.now = max(self.now, self._window_due() or self.now) + 1e-6
            return
        forwards = [(action, self._tokens(rank, action)) for rank, action in zip(self.ranks, actions, strict=True)]
        costs = [self.costs.forward_s(action, tokens) for action, tokens in forwards]
        duration = self.costs.group_step_s(forwards)
        self.all_rank_steps += len(actions)
        self.all_idle_steps += actions.count("idle")
        if self.now <= self.arrivals_end:
            self._account(actions, costs, duration)
        end = self.now + duration
        self.step_ends = end
        for rank, action in zip(self.ranks, actions, strict=True):
            self._apply(rank, action, end)
        self.now = end

    def _window_due(self) -> float | None:
        """When the batching window releases its work; None without a window (or nothing due)."""
        return self.window.due_at() if self.window else None

    def _account(self, actions: list[str], costs: list[float], duration: float) -> None:
        self.rank_steps += len(actions)
        self.idle_steps += actions.count("idle")
        self.rank_time_s += duration * len(actions)
        self.idle_time_s += duration * actions.count("idle")
        self.busy_time_s += sum(c for c, a in zip(costs, actions, strict=True) if a in ("prefill", "decode"))
        self.idle_compute_s += sum(c for c, a in zip(costs, actions, strict=True) if a == "idle")

    def _plan(self, index: int, rank: _Rank) -> StepPlan:
        if not rank.queued:
            return StepPlan(index, False, bool(rank.running), 0.0)
        oldest = rank.queued[0]
        held = tuple(dict.fromkeys(r.batch_id for r in rank.queued if r.batch_id))
        return StepPlan(
            index,
            True,
            bool(rank.running),
            (self.now - oldest.queued_at) * 1000,
            oldest.batch_id,
            oldest.batch_ranks,
            held,
        )

    def _prefill_batch(self, rank: _Rank) -> list[_Req]:
        batch: list[_Req] = []
        tokens = 0
        for req in rank.queued:
            if batch and tokens + req.trace.prompt_tokens > PREFILL_TOKEN_BUDGET:
                break
            batch.append(req)
            tokens += req.trace.prompt_tokens
        return batch

    def _tokens(self, rank: _Rank, action: str) -> int:
        """What the rank puts through its forward: prompt tokens, or sequences decoded."""
        if action == "prefill":
            return sum(r.trace.prompt_tokens for r in self._prefill_batch(rank))
        return len(rank.running) if action == "decode" else 0

    def _apply(self, rank: _Rank, action: str, end: float) -> None:
        if action == "prefill":
            for req in self._prefill_batch(rank):
                rank.queued.remove(req)
                req.ttft_s = end - req.trace.arrival_s
                req.remaining = req.trace.output_tokens - 1
                if req.remaining > 0:
                    rank.running.append(req)
                else:
                    req.done_at = end
        elif action == "decode":
            for req in list(rank.running):
                req.remaining -= 1
                if req.remaining == 0:
                    req.done_at = end
                    rank.running.remove(req)

    def _result(self, requests: list[_Req]) -> SimResult:
        ttfts = np.array([r.ttft_s for r in requests if r.ttft_s is not None])
        tokens = sum(r.trace.output_tokens for r in requests if r.done_at is not None)
        span = max((r.done_at or 0.0) for r in requests) - min(r.trace.arrival_s for r in requests)
        return SimResult(
            idle_forward_ratio=self.idle_steps / max(self.rank_steps, 1),
            idle_forward_ratio_all_steps=self.all_idle_steps / max(self.all_rank_steps, 1),
            idle_time_ratio=self.idle_time_s / max(self.rank_time_s, 1e-12),
            step_utilization=self.busy_time_s / max(self.rank_time_s, 1e-12),
            ttft_p50_s=float(np.percentile(ttfts, 50)),
            ttft_p99_s=float(np.percentile(ttfts, 99)),
            throughput_tok_s=tokens / span if span > 0 else 0.0,
            requests=len(requests),
        )
