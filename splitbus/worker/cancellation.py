"""Cancellation, a bus edge: the cancels this worker's requests get (from their API node, or the
reaper), handed to the core (``WorkerCore.cancel``, ``drop_task``), which drops the request and
frees its blocks. Deadlines and the cancel a prefill worker sends its decode side are the core's
rules (``deadlines_past``, the ``CancelPeer`` effect)."""

from __future__ import annotations

from splitbus.bus.cancel import CancelListener
from splitbus.worker.core import WorkerCore
from splitbus.worker.effects import Apply


class Cancellation:
    """``listen`` is the cancel loop's step."""

    def __init__(self, listener: CancelListener, core: WorkerCore, apply: Apply) -> None:
        self.listener, self.core, self.apply = listener, core, apply

    async def listen(self) -> None:
        """A cancel naming a task entry of this worker drops that task (its request moved to other
        workers); one naming no worker drops the request wherever it is."""
        for cancel in await self.listener.poll():
            if cancel.entry_id and cancel.worker == self.core.id:
                self.apply(self.core.drop_task(cancel.entry_id))
            elif not cancel.worker:
                self.apply(self.core.cancel(cancel.request_id))
