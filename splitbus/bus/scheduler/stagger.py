"""Staggered batch scheduling for DP groups: pure logic, shared by the scheduler and by the
discrete-event simulation in ``splitbus bench stagger``.

Requests reach DP ranks at different times; a rank with no work runs an idle forward while
the others prefill (EP's all-to-all makes every rank step). Instead of placing each arrival at
once, the scheduler holds arrivals in a short window and releases them as one batch, spread
over the ranks by water-filling on queued prefill tokens, so the ranks' prefills line up.

The window is adaptive: it closes as soon as there is a request for every rank (high load: no
waiting), else after ``STEPS_HELD`` of the group's recent step time, and never later than
``max_wait_s`` after its first arrival. Ranks only take work at a step boundary, so an arrival
waits for the running step anyway; holding it for half a step lets the arrivals of one step be
placed together, and costs little more than that wait. Held longer (we first held two steps),
batches grow but TTFT and idle forwards rise: see ``splitbus bench stagger`` in
docs/benchmarks.md for the sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")
STEPS_HELD = 0.5
STEP_EWMA = 0.2


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


def water_fill(jobs: Sequence[Job], ranks: Sequence[RankLoad]) -> dict[str, str]:
    """Assign jobs to ranks, largest first, each to the rank with the lowest level of queued
    prefill tokens that has KV blocks for it. Ties go to the rank with the most free blocks:
    the one decoding least, which would otherwise be the next to run idle forwards (a batch
    smaller than the group would else always land on the first ranks). Returns job key ->
    rank id; jobs that fit nowhere are left out."""
    levels = {r.rank_id: RankLoad(r.rank_id, r.queued_tokens, r.free_blocks) for r in ranks}
    order = {r.rank_id: i for i, r in enumerate(ranks)}
    placed: dict[str, str] = {}
    for job in sorted(jobs, key=lambda j: (-j.tokens, j.key)):
        fits = [r for r in levels.values() if r.free_blocks >= job.blocks]
        if not fits:
            continue
        target = min(fits, key=lambda r: (r.queued_tokens, -r.free_blocks, order[r.rank_id]))
        target.queued_tokens += job.tokens
        target.free_blocks -= job.blocks
        placed[job.key] = target.rank_id
    return placed


@dataclass
class StaggerWindow(Generic[T]):
    """Holds arrivals; ``release`` hands them out as one batch when the window closes."""

    ranks: int
    max_wait_s: float
    steps_held: float = STEPS_HELD
    held: list[T] = field(default_factory=list)
    opened_at: float | None = None
    step_s: float | None = None
    """Recent step time of the group (an EWMA); None until one is observed."""

    def observe_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else (1 - STEP_EWMA) * self.step_s + STEP_EWMA * seconds

    @property
    def hold_s(self) -> float:
        if self.step_s is None:
            return self.max_wait_s
        return min(self.max_wait_s, self.steps_held * self.step_s)

    def add(self, item: T, now: float) -> None:
        if self.opened_at is None:
            self.opened_at = now
        self.held.append(item)

    def due_at(self) -> float | None:
        """When the window closes at the latest (None when it holds nothing)."""
        return None if self.opened_at is None else self.opened_at + self.hold_s

    def ready(self, now: float) -> bool:
        if not self.held:
            return False
        return len(self.held) >= self.ranks or now >= (self.due_at() or now)

    def release(self) -> list[T]:
        batch, self.held, self.opened_at = self.held, [], None
        return batch
