"""``splitbus up --autoscale MIN:MAX``: ``up`` starts and drains its prefill and decode workers to
the planner's advice (``sb:planner:{cell}``, written by ``splitbus planner``, which ``up`` runs).

``reconcile`` is the rule, pure: each role's desired count clamped to [MIN, MAX], compared with
``up``'s own workers of the role (started, registered or still loading, and not draining: the
registry's count would miss those still loading and start them again); workers are started at once
for a rise, and drained one at a time per role for a fall (a drain takes its workers' streams to
their end, so the next waits for it to leave), only a fall the planner measured (``FALLS``: a hold
advises the count registered, which a worker still loading is not in) and only of a worker past its
start (registered, and started ``START_GRACE_S`` ago); nothing without advice (no planner, or one
gone: its key expires after three intervals). A planner still measuring does advise (the count
registered): a rise it advises is acted on, a fall not. ``Autoscaler`` is the shell, called from
``up``'s 0.1 s watch: it reads the advice (then, only with advice, the standings of its workers,
in one round trip), asks ``reconcile`` what to do, starts workers through the supervisor, and
retires the one that holds least (``Supervisor.retire``: SIGTERM, on which a worker started with
``--drain-timeout`` drains, then exits 0 and is not restarted).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import redis

from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.keys import Keys
from splitbus.bus.planner import Reason, read_advice
from splitbus.bus.registry import Standing, worker_standings
from splitbus.bus.roles import Role
from splitbus.cli.supervisor import Child, Supervisor
from splitbus.worker.config import default_worker_id

SCALED = (Role.PREFILL, Role.DECODE)
"""The roles ``--autoscale`` sizes (mixed workers and DP groups are not: a limit)."""
MAX_WORKERS = 1000
"""The most workers of a role ``--autoscale`` accepts as its MAX."""
READ_EVERY_S = 1.0
"""How often the advice is read: a planner decides every few seconds."""
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


@dataclass
class Fleet:
    """The autoscaled workers ``up`` runs, by role (retired ones leave ``Supervisor.children``)."""

    children: dict[str, list[Child]]

    def forget_gone(self, supervisor: Supervisor) -> list[tuple[str, Child]]:
        """Drop the retired children the supervisor has removed (they exited) and those that gave
        up (exit 2: they run no worker, though the supervisor keeps them); returns the latter."""
        gave_up = [(role, c) for role, kids in self.children.items() for c in kids if c.gave_up]
        for role, kids in self.children.items():
            self.children[role] = [c for c in kids if c in supervisor.children and not c.gave_up]
        return gave_up


def roster(kids: list[Child], standings: Mapping[int, Standing]) -> Roster[Child]:
    """A role's workers: those running, and of them the registered ones whose standing was read
    (by ``id``: past their start grace), the one holding least first."""
    running = [c for c in kids if not c.retiring]
    read = [(standings[id(c)], c) for c in running if id(c) in standings]
    drainable = [c for standing, c in sorted(read, key=lambda pair: pair[0].held) if standing.registered]
    return Roster(len(running), drainable, len(kids) - len(running))


class Autoscaler:
    """The shell: ``tick`` from ``up``'s watch. ``read`` gives the advice (None: none);
    ``start(role, index)`` starts a worker and returns its child; ``standings([(role, child)...])``
    says, in one read of the registry, whether each one's worker is registered and how many
    requests it holds; ``grace_s``: how long after its start a worker may not be drained."""

    def __init__(
        self,
        supervisor: Supervisor,
        fleet: Fleet,
        bounds: Bounds,
        read: Callable[[], Advice | None],
        start: Callable[[str, int], Child],
        standings: Callable[[Sequence[tuple[str, Child]]], list[Standing]],
        grace_s: float = START_GRACE_S,
    ) -> None:
        self.supervisor, self.fleet, self.bounds = supervisor, fleet, bounds
        self.read, self.start, self.standings, self.grace_s = read, start, standings, grace_s
        self._next_read = 0.0
        self._started: dict[str, int] = {role: len(fleet.children.get(role, [])) for role in SCALED}
        self.stuck: set[str] = set()
        """Roles a worker of which gave up: one started with the same arguments would too."""

    def tick(self) -> None:
        """Act on the advice, at most every ``READ_EVERY_S``. The advice is read first: without
        it nothing is done, and the registry is not read (``up``'s watch, which also restarts
        Redis, waits on each read)."""
        now = time.monotonic()
        if now < self._next_read:
            return
        self._next_read = now + READ_EVERY_S
        for role, child in self.fleet.forget_gone(self.supervisor):
            self.give_up(role, child)
        advice = self.read()
        if advice is None:
            return
        for action in reconcile(advice, self.rosters(now), self.bounds):
            self.act(action)

    def rosters(self, now: float) -> dict[str, Roster[Child]]:
        """Each role's workers, with the standings of those that may be drained read at once."""
        aged = [(role, c) for role, kids in self.fleet.children.items() for c in kids if self.aged(c, now)]
        standings = {id(c): standing for (_, c), standing in zip(aged, self.standings(aged), strict=True)}
        return {role: roster(kids, standings) for role, kids in self.fleet.children.items()}

    def aged(self, child: Child, now: float) -> bool:
        """Running, past its start grace and not waiting to restart: its standing is worth reading."""
        return not child.retiring and now - child.started_s >= self.grace_s and child.restart_at is None

    def give_up(self, role: str, child: Child) -> None:
        if role not in self.stuck:
            self.stuck.add(role)
            self.supervisor.say(f"autoscale: {child.name} gave up, so no {role} worker is started any more")

    def act(self, action: Start | Drain[Child]) -> None:
        if isinstance(action, Drain):
            self.supervisor.retire(action.child)
        elif action.role not in self.stuck:
            child = self.start(action.role, self._started[action.role])
            self._started[action.role] += 1
            self.fleet.children.setdefault(action.role, []).append(child)


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


def held_reader(client: redis.Redis, keys: Keys) -> Callable[[Sequence[tuple[str, Child]]], list[Standing]]:
    """Whether each child's worker is registered and what it holds (``worker_standings``, one round
    trip, under the id each was started with); Redis unreachable reads as none registered (none is
    drained meanwhile)."""

    def standings(children: Sequence[tuple[str, Child]]) -> list[Standing]:
        try:
            return worker_standings(client, keys, [worker_id(role, child) for role, child in children])
        except (redis.RedisError, OSError):
            return [Standing(registered=False, held=0)] * len(children)

    return standings


def worker_id(role: str, child: Child) -> str:
    """The id a child's worker registers under: the ``--worker-id`` it was started with (the last
    one, as argparse takes it), else the default, from its role and pid."""
    found = default_worker_id(role, child.proc.pid)
    for arg, following in zip(child.args, [*child.args[1:], None], strict=True):
        if arg == "--worker-id" and following is not None:
            found = following
        elif arg.startswith("--worker-id="):
            found = arg.partition("=")[2]
    return found
