"""The API in N processes on one port (``splitbus api --workers N``).

Each process makes its own listening socket with ``SO_REUSEPORT`` and hands it to uvicorn, so the
kernel spreads new connections over N accept queues (one per process, each ``listen`` backlog
deep), instead of N processes taking turns on one socket as uvicorn's own ``--workers`` does. Each
process is a whole API node: its own node id (``<node>-<i>``), its own result reader shard(s) and
Redis connections; they share nothing but the port, and what the bus already shares between API
nodes (tenant limits, the registry, the request stream).

A parent process supervises them: it starts N (``spawn``: nothing of the parent's state, no
thread, no connection, is inherited), forwards SIGTERM and SIGINT, and when one ends on its own it
stops the others and exits non-zero, so that whatever supervises the API (``splitbus up``,
systemd, Kubernetes) sees one part fail and restarts it whole.
"""

from __future__ import annotations

import enum
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import FrameType

log = logging.getLogger(__name__)

MAX_DEFAULT_WORKERS = 8
"""The default process count is the host's cores, but at most this many: each process holds its
own Redis connections (``ApiConfig.max_redis_connections``) and tokenizers in memory, so a large
host does not open dozens of each unasked; more can be asked for with ``--workers``."""
STOP_TIMEOUT_S = 10.0
"""How long the processes get to stop after SIGTERM before they are killed."""


def default_workers(cpus: int | None = None) -> int:
    """``--workers``' default: the host's cores (``cpus``, or ``os.cpu_count()``), 1 to
    ``MAX_DEFAULT_WORKERS``."""
    return max(1, min(cpus if cpus is not None else os.cpu_count() or 1, MAX_DEFAULT_WORKERS))


def node_ids(base: str, count: int) -> list[str]:
    """The node id of each of ``count`` processes of the API node ``base``."""
    return [f"{base}-{i}" for i in range(count)]


class NoReusePort(OSError):
    """This system has no ``SO_REUSEPORT``: several processes cannot share one port."""


def reuse_port_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that other processes of this user may bind too
    (Linux gives each its own accept queue and spreads connections by their address hash)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise NoReusePort("this system has no SO_REUSEPORT: run the API with --workers 1 (one process per port)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        except OSError as exc:
            raise NoReusePort(f"SO_REUSEPORT is refused here ({exc}): run the API with --workers 1") from exc
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class Ending(enum.Enum):
    """How a group of processes ended."""

    STOPPED = "stopped"
    """Asked to stop (SIGTERM or SIGINT to the parent); every process stopped."""
    FAILED = "failed"
    """A process ended on its own; the others were stopped."""


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
    ends; then stop the rest (SIGTERM, SIGKILL after ``STOP_TIMEOUT_S``). A target must be
    picklable (a module-level function, or a ``functools.partial`` of one)."""
    stop = _Stop()
    previous = {sig: signal.signal(sig, _mark(stop)) for sig in (signal.SIGTERM, signal.SIGINT)}
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_child, args=(target,), name=f"api-{i}") for i, target in enumerate(targets)]
    try:
        for proc in procs:
            proc.start()
        ended = _wait_first(procs, stop)
        if ended is not None:
            say(f"API process {ended.name} (pid {ended.pid}) {_how(ended.exitcode)}: stopping the others")
        _stop_all(procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return Ending.STOPPED if ended is None else Ending.FAILED


def _child(target: Callable[[], None]) -> None:
    """A process of the group: its own session (a terminal's Ctrl-C reaches the parent, which
    stops the group in order), and it ends with the parent, however the parent ends."""
    from splitbus.redis_server import die_with_parent

    os.setsid()
    die_with_parent()
    if os.getppid() == 1:  # the parent ended before the line above could take effect
        return
    target()


def _wait_first(procs: Sequence[BaseProcess], stop: _Stop) -> BaseProcess | None:
    """The first process to end, or None once the parent is asked to stop."""
    while not stop.signum:
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
