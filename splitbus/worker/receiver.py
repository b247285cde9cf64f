"""The P -> D hand-off, decode side, a bus edge: the transfer server's callbacks for a KV frame
(the core checks it and takes it into the table, the engine imports the cache between), and the
kv waits that ran out, failed unless their request was dispatched again. The reservation a
decode task waits under is written by the task feed as it takes the task."""

from __future__ import annotations

import logging

from splitbus import tracing
from splitbus.bus.core.connection import transient_suppressed
from splitbus.bus.core.loops import Loops
from splitbus.bus.dispatch import CurrentDispatch
from splitbus.bus.reaping import Reaping
from splitbus.worker import spans
from splitbus.worker.core import WorkerCore, dispatched_again
from splitbus.worker.effects import Apply
from splitbus.worker.kv_proof import Header
from splitbus.worker.sequence import Sequence

log = logging.getLogger(__name__)


class Receiver:
    """``admit_kv`` and ``import_kv`` are the transfer server's callbacks; ``expire_waits`` is
    called by the engine loop before each step."""

    def __init__(
        self, core: WorkerCore, current: CurrentDispatch, reaping: Reaping, loops: Loops, apply: Apply
    ) -> None:
        self.core, self.current, self.reaping, self.loops, self.apply = core, current, reaping, loops, apply

    def admit_kv(self, sender: str, header: Header) -> str | None:
        """Transfer-server check on D, before the frame's payload is read (``WorkerCore.admit_kv``)."""
        refusal, effects = self.core.admit_kv(sender, header)
        self.apply(effects)
        return refusal

    async def import_kv(self, sender: str, header: Header, payload: bytes) -> str | None:
        """Transfer-server callback on D, once the payload is in: take the cache and the tokens
        P generated."""
        # Checked again: while the payload came, the request may have been cancelled, or moved
        # here again under a new task and secret.
        refusal = self.admit_kv(sender, header)
        if refusal is not None:
            return refusal
        seq = self.core.start_import(header.ident)
        if tracing.on:
            spans.import_started(seq, header.meta)
        error = await self.core.engine.import_kv(seq, payload)
        refusal, effects = self.core.end_import(seq, header.meta, error)
        self.apply(effects)
        if tracing.on:
            spans.import_ended(seq, refusal)
        return refusal

    def expire_waits(self) -> None:
        """Requests whose KV did not come by the kv wait leave; each is failed, or let go if moved."""
        for seq in self.core.kv_waits_past():
            self.loops.spawn(self._expire(seq))

    async def _expire(self, seq: Sequence) -> None:
        """No KV came: fail the request, unless it was dispatched again (its new workers answer).
        A task from before hand-off ids: unless the reaper ever moved it."""
        moved = False
        with transient_suppressed("checking for a moved request"):
            if seq.task.handoff:
                moved = bool(dispatched_again(seq, await self.current.read(seq.request_id)))
            else:
                moved = await self.reaping.ever_moved(seq.request_id)
        self.apply(self.core.kv_wait_ended(seq, moved))
