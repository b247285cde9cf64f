"""Child processes of ``splitbus up``: started with their logs prefixed, restarted when they die,
stopped together.

Each child gets PR_SET_PDEATHSIG, so a ``kill -9`` of the supervisor still ends it, and its own
session, so a terminal's Ctrl-C reaches only the supervisor, which then stops the children in
order (API first).

A child that exits is started again with the same arguments after a capped exponential backoff
(:class:`RestartPolicy`), so a part that crashes at once does not spin. A worker or a scheduler
takes its id from its pid, so the restarted one is a new member: the old id's lease expires and
the reaper moves what it held (a scheduler's pending requests are claimed by the others). Exit
code 2 means the part's options or model are wrong; the same arguments would fail the same way,
so that part is not restarted. Everything here runs on the caller's thread (the relays only
print), so a restart cannot race :meth:`Supervisor.stop`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO

from splitbus.cli.common import say
from splitbus.redis_server import die_with_parent

EXIT_USAGE = 2  # argparse, and every part's "bad options or model": not restarted


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    """Wait before restarting a part that died after a stable run."""
    max_delay_s: float = 10.0
    """The cap: the wait doubles with each quick death up to this."""
    stable_s: float = 10.0
    """A part that ran at least this long counts as stable: its next wait is ``first_delay_s``."""

    def next_delay(self, previous_s: float, ran_s: float) -> float:
        if previous_s <= 0 or ran_s >= self.stable_s:
            return self.first_delay_s
        return min(self.max_delay_s, previous_s * 2)


@dataclass
class Child:
    name: str
    args: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    started_s: float = field(default_factory=time.monotonic)
    delay_s: float = 0.0
    """The last backoff wait; 0 before the first restart."""
    restart_at: float | None = None
    """When the dead child starts again (monotonic); None while it runs."""
    restarts: int = 0
    gave_up: bool = False
    exits: dict[int, str] = field(default_factory=dict)
    """What an exit code of this part means, said when it exits with it."""
    stop_signal: signal.Signals = signal.SIGTERM
    """What ``Supervisor.stop`` sends it: SIGINT for a worker on which SIGTERM drains (``up``'s own
    stop then takes seconds, not a drain's bound)."""
    retiring: bool = False
    """Sent SIGTERM by ``Supervisor.retire``: when it exits, it is removed, not restarted."""


def how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    def __init__(self, policy: RestartPolicy = RestartPolicy(), command: list[str] | None = None) -> None:
        """``command``: what runs the parts (default ``python -m splitbus.cli.main``; tests
        pass another)."""
        self.children: list[Child] = []
        self.policy = policy
        self.command = command or [sys.executable, "-m", "splitbus.cli.main"]
        self.stopping = False
        self._print_lock = threading.Lock()

    def start(
        self,
        name: str,
        args: list[str],
        env: Mapping[str, str] | None = None,
        exits: Mapping[int, str] | None = None,
        stop_signal: signal.Signals = signal.SIGTERM,
    ) -> Child:
        """Start ``splitbus ARGS``; ``env`` adds to (or overrides) this process's environment:
        secrets go there, never in ``args`` (which ``ps`` shows to every user). ``exits``: what
        this part's exit codes mean, for the line that says it ended; ``stop_signal``: what
        ``stop`` sends it."""
        proc = self._spawn(name, args, env or {})
        child = Child(name, list(args), dict(env or {}), proc, exits=dict(exits or {}), stop_signal=stop_signal)
        self.children.append(child)
        return child

    def retire(self, child: Child) -> None:
        """SIGTERM to ``child`` (a worker started with ``--drain-timeout`` drains, then exits); its
        exit is not restarted: the child is removed once it has ended. One that has ended already
        (waiting to restart, or given up) is removed at once: no restart may bring it back."""
        child.retiring = True
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
            self.say(f"{child.name} (pid {child.proc.pid}) retiring: SIGTERM")
            return
        child.restart_at = None
        self._remove_retired(child, time.monotonic())

    def _spawn(self, name: str, args: list[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [*self.command, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._relay, args=(name, proc.stdout), daemon=True).start()
        return proc

    def _relay(self, name: str, stream: IO[bytes] | None) -> None:
        assert stream is not None
        for raw in stream:
            self.say(f"{name:<10}| {raw.decode(errors='replace').rstrip()}")

    def say(self, line: str) -> None:
        with self._print_lock:
            say(line)

    def watch(self) -> str | None:
        """Restart the children that died (each after its backoff); returns why the system
        cannot go on: the API, or every scheduler, gave up (exit code 2). Call it often."""
        if self.stopping:
            return None
        now = time.monotonic()
        for child in list(self.children):  # a retired child leaves the list
            self._tend(child, now)
        return self._fatal()

    def _tend(self, child: Child, now: float) -> None:
        if child.gave_up:
            return
        if child.restart_at is not None:
            if now >= child.restart_at:
                self._restart(child, now)
            return
        code = child.proc.poll()
        if code is not None and child.retiring:
            self._remove_retired(child, now)
        elif code is not None:
            self._schedule(child, code, now)

    def _remove_retired(self, child: Child, now: float) -> None:
        if child in self.children:  # retired twice: gone already
            self.children.remove(child)
        self.say(f"{child.name} retired: {how_it_ended(child.proc.wait())} after {now - child.started_s:.1f}s")

    def _schedule(self, child: Child, code: int, now: float) -> None:
        if code == EXIT_USAGE:
            child.gave_up = True
            self.say(f"{child.name} {how_it_ended(code)} (its options or model are wrong): not restarted")
            return
        child.delay_s = self.policy.next_delay(child.delay_s, now - child.started_s)
        child.restart_at = now + child.delay_s
        meaning = f" ({child.exits[code]})" if code in child.exits else ""
        self.say(
            f"{child.name} {how_it_ended(code)}{meaning} after {now - child.started_s:.1f}s; "
            f"restarting it in {child.delay_s:.1f}s (restart {child.restarts + 1})"
        )

    def _restart(self, child: Child, now: float) -> None:
        child.proc = self._spawn(child.name, child.args, child.env)
        child.started_s, child.restart_at = now, None
        child.restarts += 1
        self.say(f"{child.name} restarted (pid {child.proc.pid})")

    def _fatal(self) -> str | None:
        if any(c.name == "api" and c.gave_up for c in self.children):
            return "the API cannot start"
        schedulers = [c for c in self.children if c.name.startswith("scheduler")]
        if schedulers and all(c.gave_up for c in schedulers):
            return "no scheduler can start"
        return None

    def kill(self) -> None:
        """SIGKILL to every child still running (a second Ctrl-C while they stop); no restart after."""
        self.stopping = True
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.kill()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Each child's stop signal (SIGTERM, or SIGINT: ``Child.stop_signal``) to every child (API
        first), SIGKILL to one that lingers; no restart after."""
        self.stopping = True
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(child.stop_signal)
                child.proc.send_signal(signal.SIGCONT)  # a stopped child (SIGSTOP) acts on it only once woken
        deadline = time.monotonic() + timeout_s  # one wait for all: they stop at once, not in turn
        for child in reversed(self.children):
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{child.name} did not stop within {timeout_s:g} s of SIGTERM: killed")
                child.proc.kill()
                child.proc.wait()
