"""The autoscaling rule, pure: what to start and what to drain for the planner's advice. ``splitbus
up --autoscale`` acts by it (``splitbus.cli.autoscale``, the shell), and so does ``splitbus bench
planner``'s simulated fleet, so that the benchmark measures what ``up`` does.

``reconcile``: each role's desired count clamped to [MIN, MAX], compared with the role's own workers
(started, registered or still loading, and not draining: the registry's count would miss those
still loading and start them again); workers are started at once for a rise, and drained one at a
time per role for a fall (a drain takes its workers' streams to their end, so the next waits for it
to leave), only a fall the planner measured (``FALLS``: a hold advises the count registered, which a
worker still loading is not in) and only of a worker past its start (registered, and started
``START_GRACE_S`` ago); nothing without advice (no planner, or one gone: its key expires after three
intervals). A planner still measuring does advise (the count registered): a rise it advises is acted
on, a fall not."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from splitbus.bus.planner import Reason
from splitbus.bus.roles import Role

SCALED = (Role.PREFILL, Role.DECODE)
"""The roles ``--autoscale`` sizes (mixed workers and DP groups are not: a limit)."""
MAX_WORKERS = 1000
"""The most workers of a role ``--autoscale`` accepts as its MAX."""
START_GRACE_S = 10.0
"""A worker younger than this is not drained even once registered: restarted under a fixed
``--worker-id``, it finds its predecessor's lease for up to a lease (3 s by default)."""
FALLS = frozenset({Reason.SLO, Reason.BACKLOG, Reason.KV_BOUND})
"""The reasons whose fall is acted on: a need the planner measured. The others hold (``measuring``,
``held``, ``slo_unreachable`` advise the count registered, which can be 0 while ``up``'s workers
load their model)."""

C = TypeVar("C")


class Advice(Protocol):
    """What ``reconcile`` reads of the planner's advice (``splitbus.bus.planner.Advice``)."""

    @property
    def desired_prefill(self) -> int: ...
    @property
    def desired_decode(self) -> int: ...
    @property
    def reason_prefill(self) -> Reason: ...
    @property
    def reason_decode(self) -> Reason: ...


@dataclass(frozen=True)
class Bounds:
    """``--autoscale MIN:MAX``: the fewest and most workers of each autoscaled role."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high <= MAX_WORKERS:
            raise ValueError(f"--autoscale MIN:MAX needs 1 <= MIN <= MAX <= {MAX_WORKERS}, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> Bounds:
        """``MIN:MAX`` as argparse's ``type`` (a bad value: argparse's usage error, exit 2)."""
        low, sep, high = text.partition(":")
        if not (sep and low.isdigit() and high.isdigit()):
            raise argparse.ArgumentTypeError(f"--autoscale takes MIN:MAX, two counts, got {text[:40]!r}")
        try:
            return cls(int(low), int(high))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    def clamp(self, count: int) -> int:
        return min(max(count, self.low), self.high)


@dataclass(frozen=True)
class Start:
    """Start one more worker of ``role``."""

    role: str


@dataclass(frozen=True)
class Drain(Generic[C]):
    """Drain ``child``, a running worker of ``role``."""

    role: str
    child: C


@dataclass(frozen=True)
class Roster(Generic[C]):
    """One autoscaled role's workers, as ``reconcile`` sees them."""

    running: int
    """Started and not draining: registered or still loading (a rise counts them all)."""
    drainable: Sequence[C] = ()
    """The running ones that may be drained (registered and past their start grace), the one to
    drain first first (the least loaded)."""
    draining: int = 0
    """How many are draining."""


def desired(advice: Advice, role: str) -> int:
    return advice.desired_prefill if role == Role.PREFILL else advice.desired_decode


def reason(advice: Advice, role: str) -> Reason:
    return advice.reason_prefill if role == Role.PREFILL else advice.reason_decode


def reconcile(advice: Advice | None, rosters: Mapping[str, Roster[C]], bounds: Bounds) -> list[Start | Drain[C]]:
    """What to do now, per autoscaled role (a role missing from ``rosters`` has no worker)."""
    if advice is None:
        return []
    actions: list[Start | Drain[C]] = []
    for role in SCALED:
        actions += _for_role(role, advice, rosters.get(role, Roster(0)), bounds)
    return actions


def _for_role(role: str, advice: Advice, roster: Roster[C], bounds: Bounds) -> list[Start | Drain[C]]:
    target = bounds.clamp(desired(advice, role))
    if target > roster.running:
        return [Start(role)] * (target - roster.running)
    if target < roster.running and reason(advice, role) in FALLS and roster.drainable and not roster.draining:
        return [Drain(role, roster.drainable[0])]
    return []
