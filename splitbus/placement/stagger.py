"""Staggered batch scheduling for DP groups: pure logic, shared by the scheduler and by the
discrete-event simulation in ``splitbus bench stagger``.

Requests reach DP ranks at different times; a rank with no work runs an idle forward while
the others prefill (EP's all-to-all makes every rank step). Instead of placing each arrival at
once, the scheduler holds arrivals in a short window and releases them as one batch, spread
over the ranks by water-filling on queued prefill tokens, so the ranks' prefills line up.

The window closes just before the group's running step ends, as its ranks announce it (each DP
rank writes, as it starts a forward, when it expects the forward to end): the arrivals of the
whole step are spread together, on the loads the next step starts from, and reach the ranks in
time for it. Ranks take work only at a step boundary, so an arrival waits for it anyway: the
hold moves that wait from the rank's queue to the window. A group that is not stepping has no
boundary to wait for, and the window closes at once. It never holds an arrival longer than
``max_wait_s``, a bound for a step that overruns its announced end; it must sit above a long
prefill step (the scheduler's default is 500 ms). At 50 ms, below an EP group's prefill steps
under load, the window closed in the middle of each step and the step's arrivals went out in two
to four batches, each water-filled without knowing the next, which lost most of what batching
gains (``splitbus bench ep`` in docs/benchmarks.md). The first version held arrivals for half of
the group's recent step time instead; in real processes that released them in the middle of a
step, a few at a time, and some missed the next step: see ``splitbus bench stagger`` in
docs/benchmarks.md.

A window holds only when more arrivals are expected before it closes (``MIN_EXPECTED``, from the
group's recent arrival rate): a batch of one has nothing to spread, and holding it cost the real
processes a step whenever its dispatch came after the step's real end (``bench ep --engine
paddle`` at light load: TTFT p50 +13 % to +21 % staggered). Such a window closes at once, and the
arrival is placed as ``dp`` (naive) places it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
RELEASE_LEAD_S = 0.01
"""How long before the announced end of a step the window closes: time for the batch's tasks to
reach the ranks (a dispatch, a read) before they plan the next step."""
MIN_EXPECTED = 1.0
"""A window holds its first arrival only if at least this many more are expected (recent rate ×
time to the step's end): otherwise the batch would be that one arrival, and holding it gains
nothing."""
RECENT_ARRIVALS = 16
"""How many arrival times a window keeps to estimate the rate."""


@dataclass
class RankLoad:
    """A rank as water-filling sees it."""

    rank_id: str
    queued_tokens: int
    free_blocks: int


@dataclass(frozen=True)
class Job:
    """A request as water-filling sees it."""

    key: str
    tokens: int
    blocks: int
    cached: Mapping[str, int] = field(default_factory=dict)
    """Its prompt tokens each rank holds cached, by rank id: computed nowhere else."""
    priority: int = 0
    """Its request's priority (lower first): a job of a lower value takes the ranks' room first."""


OVERLAP_WEIGHT = 4.0
"""The default credit per cached prompt token (docs/routing.md, "The cost": why 4)."""
LOAD_CAP_TOKENS = 16384
"""The default excess queue past which a worker gets no credit."""


@dataclass(frozen=True)
class Credit:
    """How water-filling credits a rank's cached tokens (``costs.CacheCost``'s two knobs)."""

    overlap_weight: float = OVERLAP_WEIGHT
    load_cap_tokens: int = LOAD_CAP_TOKENS


NO_CREDIT = Credit(overlap_weight=0.0)


def water_fill(jobs: Sequence[Job], ranks: Sequence[RankLoad], credit: Credit = NO_CREDIT) -> dict[str, str]:
    """Assign jobs to ranks by priority (lower first: when KV blocks run out, the lowest priority
    is what is left), and largest first within a priority, each to the rank with the lowest level of queued
    prefill tokens once it took the job (less ``overlap_weight`` per token of the job it holds
    cached, unless its level is over the lowest by more than ``load_cap_tokens``) that has KV
    blocks for it; the rank's level grows by what it computes, the job's uncached tokens. Ties
    go to the rank with the most free blocks: the one decoding least, which would otherwise be
    the next to run idle forwards (a batch smaller than the group would else always land on the
    first ranks). Returns job key -> rank id; jobs that fit nowhere are left out."""
    levels = {r.rank_id: RankLoad(r.rank_id, r.queued_tokens, r.free_blocks) for r in ranks}
    order = {r.rank_id: i for i, r in enumerate(ranks)}
    placed: dict[str, str] = {}
    for job in sorted(jobs, key=lambda j: (j.priority, -j.tokens, j.key)):
        fits = [r for r in levels.values() if r.free_blocks >= job.blocks]
        if not fits:
            continue
        floor = min(r.queued_tokens for r in fits)

        def cost(r: RankLoad, job: Job = job, floor: int = floor) -> tuple[float, int, int]:
            held = job.cached.get(r.rank_id, 0) if r.queued_tokens - floor <= credit.load_cap_tokens else 0
            return (r.queued_tokens - credit.overlap_weight * held, -r.free_blocks, order[r.rank_id])

        target = min(fits, key=cost)
        target.queued_tokens += job.tokens - job.cached.get(target.rank_id, 0)
        target.free_blocks -= job.blocks
        placed[job.key] = target.rank_id
    return placed


@dataclass
class StaggerWindow(Generic[T]):
    """Holds arrivals; ``release`` hands them out as one batch when the window closes."""

    max_wait_s: float
    held: list[T] = field(default_factory=list)
    opened_at: float | None = None
    boundary_at: float | None = None
    """When the group's running step should end, less ``RELEASE_LEAD_S``: set as the window
    opens. In the past when the group is not stepping, and ``opened_at`` when too few arrivals
    are expected before it: the window closes at once."""
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_ARRIVALS))
    """The last arrivals' times, over this window's openings: the rate it expects."""

    def open(self, now: float, boundary_at: float) -> None:
        """Called with the first arrival after a release (``now``: its arrival time)."""
        expected = self.rate_per_s(now) * (boundary_at - now)
        self.opened_at, self.boundary_at = now, boundary_at if expected >= MIN_EXPECTED else now

    def rate_per_s(self, now: float) -> float:
        """Arrivals per second over the recent ones and one at ``now``; 0 with none before."""
        if not self.recent or now <= self.recent[0]:
            return 0.0
        return len(self.recent) / (now - self.recent[0])

    def add(self, item: T, at: float) -> None:
        """Hold an arrival (that came at ``at``); the window must be open."""
        assert self.opened_at is not None, "open the window first"
        self.held.append(item)
        self.recent.append(at)

    def due_at(self) -> float | None:
        """When the window closes (None when it is not open)."""
        if self.opened_at is None or self.boundary_at is None:
            return None
        return min(self.opened_at + self.max_wait_s, max(self.opened_at, self.boundary_at))

    def ready(self, now: float) -> bool:
        due = self.due_at()
        return bool(self.held) and due is not None and now >= due

    def release(self, priority: Callable[[T], int] | None = None) -> list[T]:
        """What the window held, by ``priority`` (lower first) then arrival; by arrival without."""
        batch, self.held, self.opened_at, self.boundary_at = self.held, [], None, None
        return batch if priority is None else sorted(batch, key=priority)


def group_boundary_s(ends_ms_by_group: dict[str, list[int]]) -> float:
    """When the first of the DP groups ends its running step (wall clock, seconds): a group's
    step ends with its slowest rank's forward. 0.0 when there is none to wait for: no group, or
    a group with a rank that has not stepped yet."""
    ends = [max(ranks) if ranks and min(ranks) > 0 else 0 for ranks in ends_ms_by_group.values()]
    return min(ends, default=0) / 1000
