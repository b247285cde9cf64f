"""``splitbus up --autoscale MIN:MAX``: ``up`` starts and drains its prefill and decode workers to
the planner's advice (``sb:planner:{cell}``, written by ``splitbus planner``, which ``up`` runs).

The rule is ``splitbus.planner.autoscale.reconcile`` (pure). ``Autoscaler`` is the shell, called
from ``up``'s 0.1 s watch: it reads the advice (then, only with advice, the standings of its
workers, in one round trip), asks ``reconcile`` what to do, starts workers through the supervisor,
and retires the one that holds least (``Supervisor.retire``: SIGTERM, on which a worker started
with ``--drain-timeout`` drains, then exits 0 and is not restarted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import redis

from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.keys import Keys
from splitbus.bus.planner import Advice, read_advice
from splitbus.bus.registry import Standing, worker_standings
from splitbus.cli.supervisor import Child, Supervisor
from splitbus.planner.autoscale import SCALED, START_GRACE_S, Bounds, Drain, Roster, Start, reconcile
from splitbus.worker.config import default_worker_id

READ_EVERY_S = 1.0
"""How often the advice is read: a planner decides every few seconds."""


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
