"""Discrete-event simulation of EP + PD: one prefill DP group and one decode DP group, each
stepping in lock-step under the EP cost model (``SimConfig.group_step_s``: the slowest rank's
compute plus the all-to-all sized by the largest rank's tokens).

The prefill group is ``stagger_sim.GroupSimulation`` (its placement, window, ``decide`` and step
loop), except that a prefilled request leaves it: its KV goes to the decode rank the request was
given when it was placed, as ``splitwise_dp`` gives both ranks at once. That decode rank is the
one that keeps the decode group's step shortest (``placement.groups.step_cost``: the group's most
sequences, then most KV blocks, with the request on the rank). A decode rank steps with its group
(``decide``): it decodes its running sequences, or runs an idle forward while another rank
decodes. KV transfer time is not modelled: a request decodes from the first decode step that
starts after its prefill ends.

The two groups keep their own clocks; the decode group steps only up to the prefill group's
clock, so every hand-off that reaches it before a step is known when the step starts. As in
``stagger_sim``, counters cover the steps that start by the trace's last arrival.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from splitbus.bench.stagger_sim import (
    BLOCK,
    KV_BLOCKS_PER_RANK,
    GroupSimulation,
    TraceRequest,
    _Rank,
    _Req,
)
from splitbus.placement.groups import DecodeLoad, step_cost
from splitbus.worker.dp import StepPlan, decide
from splitbus.worker.engines.sim import SimConfig


def blocks_of(trace: TraceRequest) -> int:
    return math.ceil((trace.prompt_tokens + trace.output_tokens) / BLOCK)


@dataclass
class EpRequest(_Req):
    decode_rank: int = -1
    ready_at: float | None = None
    """When its KV is on its decode rank (its prefill's end); None while it waits to prefill."""
    decoded: int = 0


class DecodeFull(Exception):
    """A request fits on no decode rank: the trace asks for more KV than the group has."""


@dataclass
class DecodeRank:
    waiting: list[EpRequest] = field(default_factory=list)
    """Placed here, KV not here yet (its prefill has not ended)."""
    running: list[EpRequest] = field(default_factory=list)

    def load(self) -> DecodeLoad:
        held = self.waiting + self.running
        return DecodeLoad(len(held), sum(blocks_of(r.trace) for r in held))


class DecodeGroup:
    """A decode DP group: its ranks, its clock and its counters."""

    def __init__(self, ranks: int, costs: SimConfig, seed: int) -> None:
        self.ranks = [DecodeRank() for _ in range(ranks)]
        self.costs = costs
        self.rng = random.Random(seed)
        self.now = 0.0
        self.arrivals_end = 0.0
        self.rank_steps = self.idle_steps = 0
        self.idle_compute_s = 0.0
        """The ranks' compute in idle forwards over the counted steps."""
        self.imbalances: list[float] = []

    def place(self, req: EpRequest) -> None:
        """The rank that keeps the group's step shortest with the request on it, among those with
        KV room; exact ties at random (as ``groups.balanced_rank`` chooses)."""
        blocks = blocks_of(req.trace)
        loads = [r.load() for r in self.ranks]
        roomy = [i for i, ld in enumerate(loads) if KV_BLOCKS_PER_RANK - ld.kv_blocks >= blocks]
        if not roomy:
            raise DecodeFull(f"no decode rank has KV room for {blocks} blocks; shorten the trace")
        costs = step_cost(loads, [blocks] * len(loads))
        lowest = min(costs[i] for i in roomy)
        req.decode_rank = self.rng.choice([i for i in roomy if costs[i] == lowest])
        self.ranks[req.decode_rank].waiting.append(req)

    def next_start(self) -> float | None:
        """When the group's next step can start; None while it waits for hand-offs."""
        if any(r.running for r in self.ranks):
            return self.now
        ready = [q.ready_at for r in self.ranks for q in r.waiting if q.ready_at is not None]
        return max(self.now, min(ready)) if ready else None

    def step(self, at: float) -> None:
        self.now = max(self.now, at)
        for rank in self.ranks:
            self._take_kv(rank)
        plans = [StepPlan(i, False, bool(r.running), 0.0) for i, r in enumerate(self.ranks)]
        actions = [decide(p, plans, 0.0) for p in plans]
        forwards = [(a, len(r.running) if a == "decode" else 0) for a, r in zip(actions, self.ranks, strict=True)]
        duration = self.costs.group_step_s(forwards)
        if self.now <= self.arrivals_end:
            self._account(actions, [self.costs.forward_s(a, t) for a, t in forwards])
        self.now += duration
        for rank, action in zip(self.ranks, actions, strict=True):
            if action == "decode":
                self._decode(rank)

    def _take_kv(self, rank: DecodeRank) -> None:
        arrived = [q for q in rank.waiting if q.ready_at is not None and q.ready_at <= self.now]
        rank.waiting = [q for q in rank.waiting if q not in arrived]
        rank.running += arrived

    def _account(self, actions: list[str], compute: list[float]) -> None:
        self.rank_steps += len(actions)
        self.idle_steps += actions.count("idle")
        self.idle_compute_s += sum(c for c, a in zip(compute, actions, strict=True) if a == "idle")
        self.imbalances.append(max(compute) / (sum(compute) / len(compute)))

    def _decode(self, rank: DecodeRank) -> None:
        for req in list(rank.running):
            req.remaining -= 1
            if req.remaining <= 0:
                req.done_at = self.now
                rank.running.remove(req)


class PrefillGroup(GroupSimulation):
    """``GroupSimulation`` whose prefilled requests hand their KV to the decode group."""

    def __init__(
        self, ranks: int, staggered: bool, decode: DecodeGroup, max_wait_s: float, align_ms: float, costs: SimConfig
    ) -> None:
        super().__init__(ranks, staggered, max_wait_s, align_ms, costs, seed=decode.rng.randrange(2**31))
        self.decode = decode

    def _place_naive(self, req: _Req) -> None:
        super()._place_naive(req)
        self._place_decode([req])

    def _place_batch(self, batch: list[_Req]) -> None:
        super()._place_batch(batch)
        self._place_decode(batch)

    def _place_decode(self, reqs: list[_Req]) -> None:
        for req in reqs:
            assert isinstance(req, EpRequest)
            self.decode.place(req)

    def _apply(self, rank: _Rank, action: str, end: float) -> None:
        if action != "prefill":
            return
        for req in self._prefill_batch(rank):
            assert isinstance(req, EpRequest)
            rank.queued.remove(req)
            req.ttft_s, req.ready_at = end - req.trace.arrival_s, end
            req.remaining = req.trace.output_tokens - 1
            if req.remaining <= 0:
                req.done_at = end
                self.decode.ranks[req.decode_rank].waiting.remove(req)


@dataclass(frozen=True)
class EpResult:
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    prefill_idle_forward_ratio: float
    """Idle forwards per prefill rank-step (steps that start by the last arrival)."""
    decode_idle_forward_ratio: float
    prefill_idle_compute_s: float | None
    """Seconds of the prefill ranks' compute spent in idle forwards (each one costs
    ``SimConfig.forward_s("idle")``), over the same steps, per run: the waste staggering exists
    to cut. A ratio per rank-step moves with how many steps a mode takes; this does not. None
    where an idle forward's cost is not known (a real engine's processes)."""
    decode_idle_compute_s: float | None
    decode_step_imbalance: float
    """Mean over decode steps of the busiest rank's compute over the ranks' mean compute (an idle
    forward counts as its cost): 1.0 is a perfectly even group."""
    output_throughput: float
    """Output tokens per second, first arrival to last completion."""
    requests: int
    prefill_batches: int


class EpSimulation:
    """Prefill group and decode group of ``ranks`` ranks each, naive or staggered prefill."""

    def __init__(
        self, ranks: int, staggered: bool, costs: SimConfig, max_wait_s: float, align_ms: float, seed: int = 0
    ) -> None:
        self.decode = DecodeGroup(ranks, costs, seed)
        self.prefill = PrefillGroup(ranks, staggered, self.decode, max_wait_s, align_ms, costs)

    def run(self, trace: list[TraceRequest]) -> EpResult:
        requests = [EpRequest(t) for t in trace]
        self.prefill.arrivals_end = self.decode.arrivals_end = max((t.arrival_s for t in trace), default=0.0)
        upcoming: list[_Req] = list(requests)
        while True:
            prefilling = bool(upcoming) or self.prefill._busy()
            start = self.decode.next_start()
            if start is not None and (not prefilling or start <= self.prefill.now):
                self.decode.step(start)
            elif prefilling:
                upcoming = self._advance_prefill(upcoming)
            else:
                return self._result(requests)

    def _advance_prefill(self, upcoming: list[_Req]) -> list[_Req]:
        p = self.prefill
        upcoming = p._arrive(upcoming)
        if p._busy():
            p._step()
        else:
            p.now = p._next_event(upcoming)
        return upcoming

    def _result(self, requests: list[EpRequest]) -> EpResult:
        ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
        tpots = _tpots(requests)
        return EpResult(
            ttft_p50_s=float(np.percentile(ttfts, 50)),
            ttft_p99_s=float(np.percentile(ttfts, 99)),
            tpot_p50_s=float(np.percentile(tpots, 50)) if tpots else 0.0,
            prefill_idle_forward_ratio=self.prefill.idle_steps / max(self.prefill.rank_steps, 1),
            decode_idle_forward_ratio=self.decode.idle_steps / max(self.decode.rank_steps, 1),
            prefill_idle_compute_s=self.prefill.idle_compute_s,
            decode_idle_compute_s=self.decode.idle_compute_s,
            decode_step_imbalance=float(np.mean(self.decode.imbalances)) if self.decode.imbalances else 1.0,
            output_throughput=_throughput(requests),
            requests=len(requests),
            prefill_batches=self.prefill.batches,
        )


def _tpots(requests: list[EpRequest]) -> list[float]:
    """Seconds per output token after the first, of each finished request with two tokens or more."""
    return [
        (r.done_at - r.ttft_s - r.trace.arrival_s) / (r.trace.output_tokens - 1)
        for r in requests
        if r.done_at is not None and r.ttft_s is not None and r.trace.output_tokens > 1
    ]


def _throughput(requests: list[EpRequest]) -> float:
    """Output tokens of the finished requests per second, from the first arrival to the last finish."""
    tokens = sum(r.trace.output_tokens for r in requests if r.done_at is not None)
    span = max((r.done_at or 0.0) for r in requests) - min(r.trace.arrival_s for r in requests)
    return tokens / span if span > 0 else 0.0
