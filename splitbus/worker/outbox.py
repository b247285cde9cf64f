"""Where the shell's parts put the core's effects (``splitbus.worker.effects``), and what the
worker's loops wait on.

``apply`` carries out a list of effects in order, without I/O: result entries are buffered in
the result writer, acks and reservation clean-up wait in ``done_entries`` and
``stale_reservations`` for the publisher's next write, a hand-off and a cancel to the decode
side start as one-shot work, and the three events wake the loop that waits on them: ``room``
the task feed (a request left), ``wake`` the engine loop, ``asked`` the publisher. Every part
of the shell writes here and none imports another for it: the imports between the worker's
files run one way, from the shell down to the core (``tests/worker/test_layers.py``); a part
calls another only through what ``worker.py`` hands it when it builds it. ``NewRun`` is the one
flag two parts share.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from splitbus import tracing
from splitbus.bus.core.loops import Loops
from splitbus.bus.results import ResultWriter
from splitbus.worker import metrics, spans
from splitbus.worker.effects import (
    Ack,
    CancelPeer,
    Discard,
    DropReservation,
    Effect,
    Emit,
    Fail,
    Finish,
    Forget,
    Left,
    Open,
    ShipKv,
    Wake,
)
from splitbus.worker.sequence import Sequence

log = logging.getLogger(__name__)

Work = Coroutine[Any, Any, Any]


@dataclass
class NewRun:
    """Whether Redis has a new server run whose recovery is not done yet: set and cleared by the
    recovery (``Recovery.watch``, ``recover_if_owed``), read by the task feed (until it is done,
    a held task's entry missing from the stream was lost with the run, not moved by a reaper)."""

    owed: bool = False


def _no_hand_off(seq: Sequence) -> Work:
    raise RuntimeError(f"{seq.request_id}: this worker has no hand-off to ship its KV")


class Outbox:
    """``cancel(request_id, reason)`` makes the one-shot work that tells a request's decode side
    it ended here; ``ship`` is set once by the worker to its hand-off's (``HandOff.hand_off``)."""

    def __init__(self, writer: ResultWriter, loops: Loops, cancel: Callable[[str, str], Work]) -> None:
        self.writer, self.loops, self.cancel = writer, loops, cancel
        self.ship: Callable[[Sequence], Work] = _no_hand_off
        self.done_entries: list[str] = []  # task entries to ack at the next publish
        self.stale_reservations: list[tuple[str, str]] = []  # (request, task entry) of decode tasks that left
        self.room = asyncio.Event()
        """Set when a request left: the task feed, full, waits on it to read again."""
        self.wake = asyncio.Event()
        """Set when the engine loop has something new to do (work came, a request left)."""
        self.asked = asyncio.Event()
        """Set when there is something to write: the publisher waits on it."""

    def soon(self) -> None:
        """Ask the publisher for a write."""
        self.asked.set()

    def ack_later(self, entry_id: str) -> None:
        """Ack this task entry at the next publish (it is done with here)."""
        self.done_entries.append(entry_id)

    def apply(self, effects: Iterable[Effect]) -> None:
        """Carry out the core's effects, in order."""
        for effect in effects:
            self._write(effect)
            self._start(effect)

    def _write(self, effect: Effect) -> None:
        """The effects that are writes: buffered until the publisher's next write."""
        match effect:
            case Emit(request_id, token_ids, text, logprobs, prompt_logprobs):
                self.writer.tokens(request_id, list(token_ids), text, logprobs, prompt_logprobs)
                metrics.GENERATION_TOKENS.inc(len(token_ids))
            case Finish(request_id, reason, prompt, completion, text, cached):
                metrics.REQUESTS_FINISHED.labels(reason).inc()
                self.writer.finish(request_id, reason, prompt, completion, text, cached_tokens=cached)
            case Fail():
                self._fail(effect)
            case Open(request_id, reader, first_seq):
                self.writer.open(request_id, reader=reader, first_seq=first_seq)
            case Forget(request_id):
                self.writer.forget(request_id)
            case Discard(request_id):
                self.writer.discard(request_id)
            case Ack(entry_id):
                self.ack_later(entry_id)
            case DropReservation(request_id, entry_id):
                self.stale_reservations.append((request_id, entry_id))

    def _fail(self, failed: Fail) -> None:
        if failed.warn:
            log.warning("request %s failed: %s", failed.request_id, failed.message)
        else:  # a dead-lettered task's request: nothing else asks for the write
            self.soon()
        metrics.REQUESTS_FINISHED.labels(failed.code).inc()
        self.writer.fail(failed.request_id, failed.code, failed.message, failed.status, reader=failed.reader)

    def _start(self, effect: Effect) -> None:
        """The effects that start work or wake a loop."""
        match effect:
            case ShipKv(seq):
                self.loops.spawn(self.ship(seq))
            case CancelPeer(request_id, reason):
                self.loops.spawn(self.cancel(request_id, reason))
            case Left(seq):
                self.room.set()
                self.soon()
                if tracing.on and seq is not None:
                    spans.left(seq)
            case Wake():
                self.wake.set()
