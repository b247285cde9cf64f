"""What the worker's core asks the shell to do, as plain data (``splitbus.worker.core``).

The core changes its request table and its engine's blocks itself, and returns the rest as a
list of effects, in the order they must happen: the result entries to buffer (a request's
``Finish`` after its last ``Emit``, ``Forget`` after both), the task entries to ack, the KV to
ship, the cancels to send. The shell (``splitbus.worker.worker``) applies each list as it comes,
from the one event loop: it buffers what the publisher writes, and spawns the hand-offs and the
cancels. Nothing here does I/O; a test compares the lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from splitbus.bus.messages import Logprobs, Task
from splitbus.worker.sequence import Sequence


@dataclass(frozen=True)
class Open:
    """Open the request's result stream at ``first_seq`` (it is written from this worker now)."""

    request_id: str
    reader: str
    first_seq: int = 0


@dataclass(frozen=True)
class Emit:
    """The engine's new token for the request, and the text it releases."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    """The prompt's, with the request's first token only."""


@dataclass(frozen=True)
class Finish:
    """The request's last entry: it finished here (``reason``), with its usage."""

    request_id: str
    reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    cached_tokens: int


@dataclass(frozen=True)
class Fail:
    """The request's error entry. ``warn``: logged as a failure here (a request this worker held);
    a dead-lettered task's request is logged where its task is rejected."""

    request_id: str
    code: str
    message: str
    status: int
    reader: str
    warn: bool = True


@dataclass(frozen=True)
class Forget:
    """The request's result stream is done with here (what was buffered still goes out)."""

    request_id: str


@dataclass(frozen=True)
class Discard:
    """Drop what is buffered for the request, unwritten: it moved to another worker."""

    request_id: str


@dataclass(frozen=True)
class Ack:
    """Ack this task entry at the next publish: it is done with here."""

    entry_id: str


@dataclass(frozen=True)
class DropReservation:
    """A decode task left: its KV reservation in ``sb:kv`` goes at the next publish."""

    request_id: str
    entry_id: str


@dataclass(frozen=True)
class Left:
    """A request left and freed its blocks: the task feed may read again, the publisher writes;
    its spans still open end (``splitbus.worker.spans.left``)."""

    seq: Sequence | None = field(default=None, compare=False)
    """The task that left (not compared: an effect is what it does, not whose it is)."""


@dataclass(frozen=True)
class Wake:
    """The engine loop has something new to look at (a request left, or became RUNNING)."""


@dataclass(frozen=True)
class ShipKv:
    """A prefilled request (HANDING_OFF): ship its KV cache to its decode worker."""

    seq: Sequence


@dataclass(frozen=True)
class CancelPeer:
    """Tell the decode side of the request that it ended here (it waits for KV that never comes)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class DeadLetter:
    """Take the task entry out of circulation with ``reason`` (a poisoned request's). Not an
    ``Effect``: the shell writes it, awaited, before it asks the core what the request comes to
    (``WorkerCore.poison_letter``, then ``poisoned``), so that a letter that raises leaves the
    request held."""

    entry_id: str
    task: Task
    reason: str


Effect = Open | Emit | Finish | Fail | Forget | Discard | Ack | DropReservation | Left | Wake | ShipKv | CancelPeer
"""One thing the shell must do; a core method returns a list of them, in order."""
Apply = Callable[[Iterable[Effect]], None]
"""How a part of the shell hands the core's effects on (``Worker.apply``)."""
