"""Hop marks: a request's way through each process, stamped to the nanosecond, for ``bench serve``'s
hop breakdown (``splitbus.bench.hop_trace``). Off unless ``SPLITBUS_HOP_MARKS`` names a folder when
the process starts: then each call site (behind ``if hopmarks.on:``, one attribute read when off)
appends ``(request id, mark, time.time_ns())`` to a list in memory, and ``flush`` writes the list
to ``FOLDER/PID.marks``, one ``ID MARK NS`` line a mark, where a process is about to wait (before
a blocking read): no file write between two marks of one hop. The wall clock, as the ``ts`` of the
bus's entries, so that marks from every process on one host and the entries' stamps compare.

Not tracing (``splitbus.tracing``): no exporter, no span objects, nothing but a tuple a mark. For
benchmarks only; a deployment never sets it: the file grows by a line a mark, several a request,
and nothing trims it. The file is opened when this module is imported: a folder that cannot take
it turns the marks off with one warning then (and so does a later write that fails), never an
error in the bus's read loops, which flush. A request id with whitespace (a space or a line
break would break its line) is left out."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

ENV = "SPLITBUS_HOP_MARKS"
FOLDER = os.environ.get(ENV, "")
on = bool(FOLDER)
"""Whether marks are kept (``SPLITBUS_HOP_MARKS`` set when this module was imported, and its
folder writable)."""
_marks: list[tuple[str, str, int]] = []
_fd: int | None = None
_fd_pid = 0
"""The process that opened ``_fd``: a forked child opens a file of its own."""


def mark(request_id: str, name: str, ns: int | None = None) -> None:
    """Stamp ``name`` for ``request_id`` now (or at ``ns``, a ``time.time_ns()`` taken earlier)."""
    _marks.append((request_id, name, time.time_ns() if ns is None else ns))


def mark_message(message: Any, name: str, ns: int | None = None) -> None:
    """Stamp ``name`` for the request a bus message carries: a request (``request_id``) or a task
    (its ``request``'s); nothing for another message."""
    request_id = getattr(message, "request_id", None) or getattr(getattr(message, "request", None), "request_id", None)
    if isinstance(request_id, str):
        mark(request_id, name, ns)


def mark_entry(request_id: str, seq: int, name: str, ns: int | None = None) -> None:
    """Stamp ``name`` for one result entry of ``request_id`` (its ``seq``): the token path's marks,
    one set a token, under ``REQUEST_ID/SEQ`` (``entry_key``)."""
    _marks.append((entry_key(request_id, seq), name, time.time_ns() if ns is None else ns))


def entry_key(request_id: str, seq: int) -> str:
    """The id a result entry's marks are kept under: its request's, ``/``, its seq."""
    return f"{request_id}/{seq}"


def flush() -> None:
    """Write the marks kept so far to this process's file (appended) and forget them; marks off,
    with a warning, if the file cannot be written."""
    if not _marks:
        return
    lines = "".join(f"{request_id} {name} {ns}\n" for request_id, name, ns in _marks if _one_word(request_id))
    _marks.clear()
    try:
        os.write(_file(), lines.encode())
    except OSError as exc:
        _off(exc)


def _one_word(request_id: str) -> bool:
    """No whitespace in it (``str.split``'s is every line break ``splitlines`` reads by)."""
    return request_id.split() == [request_id]


def _file() -> int:
    """This process's marks file, opened (created) on first use."""
    global _fd, _fd_pid
    if _fd is None or _fd_pid != os.getpid():
        _fd = os.open(os.path.join(FOLDER, f"{os.getpid()}.marks"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        _fd_pid = os.getpid()
    return _fd


def _off(exc: OSError) -> None:
    """Marks off for the rest of this process (one warning): their file cannot be written."""
    global on
    on = False
    _marks.clear()
    log.warning("hop marks off: %s=%s cannot be written: %s", ENV, FOLDER, exc)


def start() -> None:
    """Open the marks file now, if marks are on (at import): a bad folder warns at a process's start."""
    if on:
        try:
            _file()
        except OSError as exc:
            _off(exc)


start()
