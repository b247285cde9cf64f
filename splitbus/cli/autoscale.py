"""``splitbus up --autoscale MIN:MAX``: ``up`` starts and drains its prefill and decode workers to
the planner's advice (``sb:planner:{cell}``, written by ``splitbus planner``, which ``up`` runs).

``reconcile`` is the rule, pure: each role's desired count clamped to [MIN, MAX]; workers are
started at once for a rise, and drained one at a time per role for a fall (a drain takes its
workers' streams to their end, so the next waits for it to leave); nothing without advice (the
planner is gone or still measuring: its key expires after three intervals). ``Autoscaler`` is the
shell, called from ``up``'s 0.1 s watch: it reads the advice, asks ``reconcile`` what to do, starts
workers through the supervisor, and retires the one that holds least (``Supervisor.retire``:
SIGTERM, on which a worker started with ``--drain-timeout`` drains, then exits 0 and is not
restarted).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Generic, Protocol, TypeVar

import redis

from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.keys import Keys
from splitbus.bus.planner import read_advice
from splitbus.bus.registry import held_requests
from splitbus.bus.roles import Role
from splitbus.cli.supervisor import Child, Supervisor
from splitbus.worker.config import default_worker_id

SCALED = (Role.PREFILL, Role.DECODE)
"""The roles ``--autoscale`` sizes (mixed workers and DP groups are not: a limit)."""
MAX_WORKERS = 1000
"""The most workers of a role ``--autoscale`` accepts as its MAX."""
READ_EVERY_S = 1.0
"""How often the advice is read: a planner decides every few seconds."""

C = TypeVar("C")


class Advice(Protocol):
    """What ``reconcile`` reads of the planner's advice (``splitbus.bus.planner.Advice``)."""

    @property
    def desired_prefill(self) -> int: ...
    @property
    def desired_decode(self) -> int: ...


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


def desired(advice: Advice, role: str) -> int:
    return advice.desired_prefill if role == Role.PREFILL else advice.desired_decode


def reconcile(
    advice: Advice | None, running: Mapping[str, Sequence[C]], draining: Mapping[str, int], bounds: Bounds
) -> list[Start | Drain[C]]:
    """What to do now, per autoscaled role. ``running``: the role's workers that are not draining,
    the first the one to drain first (the least loaded); ``draining``: how many are draining."""
    if advice is None:
        return []
    actions: list[Start | Drain[C]] = []
    for role in SCALED:
        have, target = running.get(role, ()), bounds.clamp(desired(advice, role))
        if target > len(have):
            actions += [Start(role)] * (target - len(have))
        elif target < len(have) and not draining.get(role, 0):
            actions.append(Drain(role, have[0]))
    return actions


@dataclass
class Fleet:
    """The autoscaled workers ``up`` runs, by role (retired ones leave ``Supervisor.children``)."""

    children: dict[str, list[Child]]

    def running(self) -> dict[str, list[Child]]:
        return {role: [c for c in kids if not c.retiring] for role, kids in self.children.items()}

    def draining(self) -> dict[str, int]:
        return {role: sum(c.retiring for c in kids) for role, kids in self.children.items()}

    def forget_gone(self, supervisor: Supervisor) -> None:
        """Drop the retired children the supervisor has removed (they exited)."""
        for role, kids in self.children.items():
            self.children[role] = [c for c in kids if c in supervisor.children]


class Autoscaler:
    """The shell: ``tick`` from ``up``'s watch. ``read`` gives the advice (None: none);
    ``start(role, index)`` starts a worker and returns its child; ``held(role, child)`` says how
    many requests its worker holds (running + waiting, from the registry)."""

    def __init__(
        self,
        supervisor: Supervisor,
        fleet: Fleet,
        bounds: Bounds,
        read: Callable[[], Advice | None],
        start: Callable[[str, int], Child],
        held: Callable[[str, Child], int],
    ) -> None:
        self.supervisor, self.fleet, self.bounds = supervisor, fleet, bounds
        self.read, self.start, self.held = read, start, held
        self._next_read = 0.0
        self._started: dict[str, int] = {role: len(fleet.children.get(role, [])) for role in SCALED}

    def tick(self) -> None:
        """Act on the advice, at most every ``READ_EVERY_S``."""
        now = time.monotonic()
        if now < self._next_read:
            return
        self._next_read = now + READ_EVERY_S
        self.fleet.forget_gone(self.supervisor)
        running = {role: sorted(kids, key=partial(self.held, role)) for role, kids in self.fleet.running().items()}
        for action in reconcile(self.read(), running, self.fleet.draining(), self.bounds):
            self.act(action)

    def act(self, action: Start | Drain[Child]) -> None:
        if isinstance(action, Start):
            child = self.start(action.role, self._started[action.role])
            self._started[action.role] += 1
            self.fleet.children.setdefault(action.role, []).append(child)
        else:
            self.supervisor.retire(action.child)


def advice_reader(client: redis.Redis, keys: Keys, say: Callable[[str], None]) -> Callable[[], Advice | None]:
    """``read_advice`` on ``up``'s client, for ``Autoscaler``: Redis unreachable, or a hash that is
    not a sane advice, is no advice (nothing is done), said once until it changes."""
    said = [""]

    def read() -> Advice | None:
        try:
            advice, why = read_advice(client, keys), ""
        except (redis.RedisError, OSError, DecodeError) as exc:
            advice, why = None, f"autoscale: no advice read ({type(exc).__name__}: {str(exc)[:200]}); nothing changes"
        if why != said[0] and why:
            say(why)
        said[0] = why
        return advice

    return read


def held_reader(client: redis.Redis, keys: Keys) -> Callable[[str, Child], int]:
    """Requests a child's worker holds (``held_requests``; Redis unreachable reads as none: it only
    orders which worker drains first)."""

    def held(role: str, child: Child) -> int:
        try:
            return held_requests(client, keys, default_worker_id(role, child.proc.pid))
        except (redis.RedisError, OSError):
            return 0

    return held
