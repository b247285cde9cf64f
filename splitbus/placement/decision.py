"""What a policy answers: one type for where a request's tasks go, whichever way it was decided.

``Policy.place`` decides one request: ``Placed`` (its tasks) or ``NoPlacement`` (why none, now).
``Policy.admit`` decides the arrivals of one loop step: ``Admitted``, whose placed requests are
each a ``Placed`` too, so the scheduler and the API write every decision the same way
(``Dispatcher``), one dispatch per ``Placed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitbus.bus.core.streams import Delivery
from splitbus.bus.records import Reserved
from splitbus.bus.registry import WorkerInfo


@dataclass(frozen=True)
class Placement:
    """One task to write: the worker, the phase, the peer, and the load to reserve."""

    worker: WorkerInfo
    phase: str
    peer: str
    reserve: Reserved
    batch_id: str = ""
    batch_ranks: int = 0
    twins: int = 1
    """A choice's prefill task: how many of its response's choices this decision's replica sends
    to that worker together (``Task.twins``, ``placement.siblings``)."""


@dataclass
class Waiting:
    """A request entry the scheduler holds until it is placed, and since when (monotonic)."""

    delivery: Delivery
    since: float


@dataclass(frozen=True)
class Placed:
    """A placement exists: the tasks to write, in order (a decode task before its prefill)."""

    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        # The dispatch acks the request's entry and writes these tasks: with none, the request would be
        # gone without a task or an error, and its client would wait out its deadline.
        if not self.placements:
            raise ValueError("a placement writes at least one task (say NoPlacement(reason) when there is none)")


@dataclass(frozen=True)
class NoPlacement:
    """No placement exists now, and why: the request waits, and once it has waited
    ``no_worker_wait_s`` (unless ``busy``) its client gets a 503 that says this."""

    reason: str
    busy: bool = False
    """The workers are there but their queues are full (``PolicyOptions.max_queued_prefill_tokens``):
    the request waits for room until its deadline, not ``no_worker_wait_s``."""
    model_wide: bool = False
    """``busy`` whatever the request but its priority: every worker of the model that could
    prefill it is at the bound, not only those with room for this one, so a later request of the
    model and priority is answered the same until a queue opens (the scheduler asks the policy
    once a pass)."""


def no_room(model: str, role: str, open_rooms: int, model_wide: bool = False) -> NoPlacement:
    """Why no worker of ``role`` takes a request for ``model`` now: none with room for it
    (``open_rooms`` 0), or every one that has room has a full prefill queue (``busy``: the
    request waits for room; ``model_wide``: whatever the request)."""
    if open_rooms:
        reason = f"every {role} worker with room for model '{model}' has a full prefill queue"
        return NoPlacement(reason, busy=True, model_wide=model_wide)
    return NoPlacement(f"no live {role} worker with room serves model '{model}'")


Decision = Placed | NoPlacement
"""Where one request's tasks go now, or why nowhere."""


@dataclass(frozen=True)
class Admitted:
    """What ``admit`` did with the arrivals of one loop step."""

    queue: list[Waiting]
    """Requests that join the waiting queue now, to be placed one at a time by ``place``."""
    placed: list[tuple[Waiting, Placed]] = field(default_factory=list)
    """Requests the policy placed itself, as one batch, each with its decision: the scheduler
    reserves their load and writes them (one dispatch each) before it places the queue."""
    wake_at: float | None = None
    """When (monotonic seconds) the loop must call ``admit`` again for the requests the policy
    still holds: the loop's read blocks no longer than that. None when it holds none."""
