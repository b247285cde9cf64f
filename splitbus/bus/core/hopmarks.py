"""Hop marks: a request's way through each process, stamped to the nanosecond, for ``bench serve``'s
hop breakdown (``splitbus.bench.hop_trace``). Off unless ``SPLITBUS_HOP_MARKS`` names a folder when
the process starts: then each call site (behind ``if hopmarks.on:``, one attribute read when off)
appends ``(request id, mark, time.time_ns())`` to a list in memory, and ``flush`` writes the list
to ``FOLDER/PID.marks``, one ``ID MARK NS`` line a mark, where a process is about to wait (before
a blocking read): no file write between two marks of one hop. The wall clock, as the ``ts`` of the
bus's entries, so that marks from every process on one host and the entries' stamps compare.

Not tracing (``splitbus.tracing``): no exporter, no span objects, nothing but a tuple a mark, and
only for benchmarks; a deployment never sets it."""

from __future__ import annotations

import os
import time
from typing import Any

ENV = "SPLITBUS_HOP_MARKS"
FOLDER = os.environ.get(ENV, "")
on = bool(FOLDER)
"""Whether marks are kept (``SPLITBUS_HOP_MARKS`` set when this module was imported)."""
_marks: list[tuple[str, str, int]] = []
_fd: int | None = None


def mark(request_id: str, name: str, ns: int | None = None) -> None:
    """Stamp ``name`` for ``request_id`` now (or at ``ns``, a ``time.time_ns()`` taken earlier)."""
    _marks.append((request_id, name, time.time_ns() if ns is None else ns))


def mark_message(message: Any, name: str, ns: int | None = None) -> None:
    """Stamp ``name`` for the request a bus message carries: a request (``request_id``) or a task
    (its ``request``'s); nothing for another message."""
    request_id = getattr(message, "request_id", None) or getattr(getattr(message, "request", None), "request_id", None)
    if isinstance(request_id, str):
        mark(request_id, name, ns)


def flush() -> None:
    """Write the marks kept so far to this process's file (appended) and forget them."""
    global _fd
    if not _marks:
        return
    lines = "".join(f"{request_id} {name} {ns}\n" for request_id, name, ns in _marks if " " not in request_id)
    _marks.clear()
    if _fd is None:
        _fd = os.open(os.path.join(FOLDER, f"{os.getpid()}.marks"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.write(_fd, lines.encode())
