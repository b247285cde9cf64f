"""The API in N processes on one port (``splitbus api --workers N``).

Each process binds its own socket with ``SO_REUSEPORT`` and hands it to uvicorn, which listens on
it once the app has started (a socket bound but not listening is given no connections), so the
kernel spreads new connections over N accept queues (one per process, each ``listen`` backlog
deep), instead of N processes taking turns on one socket as uvicorn's own ``--workers`` does. Each
process is a whole API node: its own node id (``<node>-<i>``), its own result reader shard(s) and
Redis connections; they share nothing but the port, and what the bus already shares between API
nodes (tenant limits, the registry, the request stream).

A parent process supervises them: it first makes sure the port is free (``check_port``: a second
group would otherwise join the first's port silently), starts N (``spawn``: nothing of the
parent's state, no thread, no connection, is inherited), forwards SIGTERM and SIGINT, and when one
ends on its own it stops the others and exits non-zero, so that whatever supervises the API
(``splitbus up``, systemd, Kubernetes) sees one part fail and restarts it whole. The processes die
with it however it ends (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import enum
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)

MAX_DEFAULT_WORKERS = 8
"""The default process count is the host's cores, but at most this many: each process holds its
own Redis connections (``ApiConfig.max_redis_connections``) and tokenizers in memory, so a large
host does not open dozens of each unasked; more can be asked for with ``--workers``."""
STOP_TIMEOUT_S = 8.0
"""How long the processes get to stop after SIGTERM before the parent kills them: less than the
10 s ``splitbus up`` gives the parent (``Supervisor.stop``) before it kills the parent, so that the
group is stopped by its own parent, not left to die of its death."""
EXIT_USAGE = 2
"""A process's exit code for a start that cannot work (the port cannot be shared): the parent
exits with it too, so that ``splitbus up`` gives up instead of restarting the same failure."""


def default_workers(cpus: int | None = None) -> int:
    """``--workers``' default: the cores this process may use (``cpus``, or ``usable_cpus()``), 1
    to ``MAX_DEFAULT_WORKERS``."""
    return max(1, min(cpus if cpus is not None else usable_cpus(), MAX_DEFAULT_WORKERS))


def usable_cpus() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a cpuset), fewer where
    its cgroup's CPU quota (a container's ``--cpus``) allows fewer. 1 off Linux, whose kernel
    alone spreads one port's connections over several processes' sockets."""
    if not sys.platform.startswith("linux"):
        return 1
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpus()
    return cpus if quota is None else min(cpus, quota)


def cgroup_cpus(cgroups: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPU quota of this process's own cgroup (v2 ``cpu.max``: quota and period), rounded up
    to whole cores; None where there is none (``max``) or it cannot be read (cgroup v1)."""
    try:
        path = next(line[3:] for line in cgroups.read_text().splitlines() if line.startswith("0::"))
        quota, period = (root / path.lstrip("/") / "cpu.max").read_text().split()
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, StopIteration):  # no v2 line, no file, or "max": no quota
        return None


def node_ids(base: str, count: int) -> list[str]:
    """The node id of each of ``count`` processes of the API node ``base``."""
    return [f"{base}-{i}" for i in range(count)]


class NoReusePort(OSError):
    """This system has no ``SO_REUSEPORT``: several processes cannot share one port."""


def check_port(host: str, port: int) -> None:
    """Raise ``OSError`` (``EADDRINUSE``) if anything listens on ``host:port``, another group of
    API processes included, whose ``SO_REUSEPORT`` sockets would let this group's join them
    unseen; ``NoReusePort`` if the group could not share it. Checked by binding a socket without
    ``SO_REUSEPORT``, released at once. (With ``SO_REUSEADDR``, as the group's own sockets have:
    the connections a stopped group left in TIME_WAIT do not hold the port; so neither does a
    group whose processes have bound and not yet listened, in the seconds they start.)"""
    _check_reuse_port()
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other processes of this user may bind too
    (Linux gives each its own accept queue and spreads connections by their address hash). It
    does not listen: whoever serves on it listens once it can serve (uvicorn does, after the app's
    startup), so that no connection waits in the queue of a process that may yet fail to start."""
    _check_reuse_port()
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        except OSError as exc:
            raise NoReusePort(f"SO_REUSEPORT is refused here ({exc}): run the API with --workers 1") from exc
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _check_reuse_port() -> None:
    if not hasattr(socket, "SO_REUSEPORT"):
        raise NoReusePort("this system has no SO_REUSEPORT: run the API with --workers 1 (one process per port)")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class Ending(enum.Enum):
    """How a group of processes ended."""

    STOPPED = "stopped"
    """Asked to stop (SIGTERM or SIGINT to the parent); every process stopped."""
    FAILED = "failed"
    """A process ended on its own; the others were stopped."""
    REFUSED = "refused"
    """A process exited with ``EXIT_USAGE`` (it could not start as asked; it exits so only before
    it serves); the others were stopped."""

    @property
    def exit_code(self) -> int:
        """The parent's: 0 stopped, 1 failed, ``EXIT_USAGE`` refused (a usage error, which
        ``splitbus up`` does not restart: the same start would fail the same way)."""
        return {Ending.STOPPED: 0, Ending.FAILED: 1, Ending.REFUSED: EXIT_USAGE}[self]


@dataclass
class _Stop:
    """The signal the parent was sent, if any (set by its handler, read by its loop)."""

    signum: int = 0


def _mark(stop: _Stop) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, _frame: FrameType | None) -> None:
        stop.signum = signum

    return handler


def run_group(targets: Sequence[Callable[[], None]], say: Callable[[str], None]) -> Ending:
    """Run each target in a process of its own until the parent is asked to stop or one of them
    ends; then stop the rest (SIGTERM, SIGKILL after ``STOP_TIMEOUT_S``), those started before
    one failed to start included. A target must be picklable (a module-level function, or a
    ``functools.partial`` of one)."""
    stop = _Stop()
    previous = {sig: signal.signal(sig, _mark(stop)) for sig in (signal.SIGTERM, signal.SIGINT)}
    context = multiprocessing.get_context("spawn")
    procs = [
        context.Process(target=_child, args=(target, os.getpid()), name=f"api-{i}") for i, target in enumerate(targets)
    ]
    try:
        for proc in procs:
            proc.start()
        ended = _wait_first(procs, stop)
        if ended is not None and not stop.signum:
            say(f"API process {ended.name} (pid {ended.pid}) {_how(ended.exitcode)}: stopping the others")
    finally:
        _stop_all([proc for proc in procs if proc.pid is not None])
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return _ending(ended, stop)


def _ending(ended: BaseProcess | None, stop: _Stop) -> Ending:
    """How the group ended, judged once it has stopped: a process that ended while the parent was
    asked to stop (a SIGTERM sent to every process at once, as systemd's stop does, can reach a
    child first) is part of an orderly stop, not a failure."""
    if ended is None or stop.signum:
        return Ending.STOPPED
    return Ending.REFUSED if ended.exitcode == EXIT_USAGE else Ending.FAILED


def _child(target: Callable[[], None], parent: int) -> None:
    """A process of the group: its own session (a terminal's Ctrl-C reaches the parent, which
    stops the group in order), and it ends with the parent, however the parent ends: killed at
    once (an orderly stop always comes through the parent, so there is nothing to wait for)."""
    from splitbus.redis_server import die_with_parent

    os.setsid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the line above could take effect
        return
    target()


def _wait_first(procs: Sequence[BaseProcess], stop: _Stop) -> BaseProcess | None:
    """The first process to end, or None once the parent is asked to stop."""
    while not stop.signum:
        # A signal's handler only marks ``stop`` (Python retries an interrupted wait: PEP 475),
        # so the wait ends every 0.2 s to look at it: a stop is acted on within 0.2 s.
        multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.2)
        for proc in procs:
            if proc.exitcode is not None:
                return proc
    return None


def _stop_all(procs: Sequence[BaseProcess]) -> None:
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            log.warning("API process %s did not stop within %g s of SIGTERM: killed", proc.name, STOP_TIMEOUT_S)
            proc.kill()
            proc.join()


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
