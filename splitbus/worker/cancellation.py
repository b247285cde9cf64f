"""Cancellation and deadlines: a request cancelled by its API node (or the reaper) or past its
deadline leaves this worker, freeing its blocks; a prefill worker tells the decode side when it
ends a request the decode side waits for."""

from __future__ import annotations

import logging
import time

from splitbus.bus.cancel import CancelListener, publish_cancel
from splitbus.worker.publisher import Publisher
from splitbus.worker.requests import DROPPABLE, Status
from splitbus.worker.sequence import Sequence
from splitbus.worker.shared import Shared

log = logging.getLogger(__name__)
RECENT_CANCELS = 10_000
"""How many cancelled request ids are remembered (a task of one that comes later is dropped)."""


class Cancellation:
    """``listen`` is the cancel loop's step; it calls ``drop`` for a request's cancel and
    ``drop_task`` for a cancel naming one of this worker's task entries (the reaper moved its
    request). ``expire_deadlines`` is called by the engine loop before each step. ``cancel_peer``
    is called on a prefill worker when a request its decode side waits for ends here (finished
    at its first token, or its hand-off failed). ``request_id in cancellation`` is asked by the
    task feed (a task of a request cancelled lately is not taken) and the hand-off (it stops
    retrying)."""

    def __init__(self, shared: Shared, publisher: Publisher) -> None:
        self.redis, self.config, self.id = shared.redis, shared.config.bus, shared.id
        self.table, self.loops, self.wake = shared.table, shared.loops, shared.wake
        self.publisher = publisher
        self.listener = CancelListener(self.redis, self.config)
        self.recent: dict[str, float] = {}

    def __contains__(self, request_id: str) -> bool:
        """Whether the request was cancelled lately."""
        return request_id in self.recent

    async def listen(self) -> None:
        """The cancel loop's step: a cancel naming a task entry of this worker drops that task (its
        request moved to other workers); one naming no worker drops the request wherever it is."""
        for cancel in await self.listener.poll():
            if cancel.entry_id and cancel.worker == self.id:
                self.drop_task(cancel.entry_id)
            elif not cancel.worker:
                self.drop(cancel.request_id)

    def drop(self, request_id: str) -> None:
        """Forget a cancelled request wherever it is here, freeing its blocks."""
        self.recent[request_id] = time.monotonic()
        while len(self.recent) > RECENT_CANCELS:
            self.recent.pop(next(iter(self.recent)))
        seq = self.table.take(request_id, *DROPPABLE)
        if seq is not None:
            log.info("dropped cancelled request %s", request_id)
            self.publisher.retire(seq)
            self.wake.set()

    def drop_task(self, entry_id: str) -> None:
        """Forget one task (its request moved to other workers), freeing its blocks."""
        for seq in [s for s in self.table.of(Status.AWAITING_KV) if s.entry_id == entry_id]:
            self.table.remove(seq)
            self.publisher.retire(seq)
            self.wake.set()

    def expire_deadlines(self) -> None:
        """Past its deadline a request ends here with an error, freeing its blocks, whether or
        not its API node is still there to cancel it."""
        now_ms = time.time() * 1000
        for seq in [s for s in self.table.of(*DROPPABLE) if s.request.deadline_ms and now_ms > s.request.deadline_ms]:
            self.table.remove(seq)
            self.publisher.fail(seq, "deadline", "the request's deadline passed before it finished", 504)

    def cancel_peer(self, seq: Sequence, reason: str) -> None:
        """Tell the decode side of ``seq`` that it ended here (it would wait for KV that never comes)."""
        self.loops.spawn(publish_cancel(self.redis, self.config, seq.request_id, reason))
