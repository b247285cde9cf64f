"""The P -> D hand-off, decode side: reserve blocks for a decode task in ``sb:kv``, take the KV
frame its prefill worker sends (only that one, proven with the reservation's secret), and fail
the request if no cache comes in time."""

from __future__ import annotations

import logging
import time

from splitbus.bus.core.connection import transient_suppressed
from splitbus.bus.dispatch import CurrentDispatch
from splitbus.bus.reaping import Reaping
from splitbus.bus.reservations import Reservation, Reservations
from splitbus.worker.handoff import dispatched_again, meta_problem
from splitbus.worker.publisher import Publisher
from splitbus.worker.requests import Status
from splitbus.worker.sequence import Sequence
from splitbus.worker.shared import Shared
from splitbus.worker.transfer import Header, new_secret, proof_matches

log = logging.getLogger(__name__)


class Receiver:
    """``admit_kv`` and ``import_kv`` are the transfer server's callbacks; ``expect`` is called
    for each decode task taken, ``expire_waits`` by the engine loop."""

    def __init__(self, shared: Shared, publisher: Publisher, reservations: Reservations) -> None:
        self.config, self.id, self.redis, self.keys = shared.config, shared.id, shared.redis, shared.config.bus.keys
        self.table, self.engine, self.loops, self.wake = shared.table, shared.engine, shared.loops, shared.wake
        self.publisher, self.reservations = publisher, reservations
        self.current, self.reaping = CurrentDispatch(self.redis, self.keys), Reaping(self.redis, self.keys)
        self.endpoint = ""
        """This worker's transfer endpoint (set once its server listens), named in each reservation."""

    async def expect(self, seq: Sequence) -> None:
        """A decode task with its blocks: wait for its KV, reserved in ``sb:kv`` for its dispatch."""
        # The secret makes the reservation usable only by who can read it from Redis: P proves
        # it in its KV frame, so knowing a request id (every client does) is not enough to send one.
        seq.kv_secret = new_secret()
        self.table.add(seq, Status.AWAITING_KV, kv_deadline=time.monotonic() + self.config.kv_wait_s)
        if not await self.reservations.reserve(seq.request_id, self.reservation_of(seq)):
            # The reaper replaced this task's dispatch before it came here: nobody will send its KV.
            log.info("task %s of %s is void (the request was dispatched again); dropped", seq.entry_id, seq.request_id)
            if self.table.remove(seq):
                self.publisher.retire(seq)

    def reservation_of(self, seq: Sequence) -> Reservation:
        """The reservation of a decode task that holds its blocks (``expect`` gave it its secret)."""
        return Reservation(
            decode_worker=self.id,
            endpoint=self.endpoint,
            blocks=seq.blocks,
            prefill_worker=seq.task.peer,
            task_entry=seq.entry_id,
            secret=seq.kv_secret,
            handoff=seq.task.handoff,
        )

    async def reserve_again(self, seq: Sequence) -> bool:
        """After a new Redis run: write the reservation of a task still waiting for its KV again
        if the run lost it (the same secret: a frame P sends for the old one is still taken).
        Whether it was written."""
        if await self.reservations.read(seq.request_id) is not None:
            return False
        if not self.table.holds(seq, Status.AWAITING_KV):  # its KV came, or it left, during the read
            return False
        return await self.reservations.reserve(seq.request_id, self.reservation_of(seq))

    def admit_kv(self, sender: str, header: Header) -> str | None:
        """Transfer-server check on D, before the frame's payload is read. A frame not from the
        task's P, or without the proof of the reservation's secret, is refused and changes
        nothing: the reservation waits for the real P (a stranger must not be able to fail
        someone else's request). A proven frame that is larger than the reserved blocks or
        whose meta P could not have sent fails the request, freeing its blocks."""
        seq = self.table.get(header.ident, Status.AWAITING_KV)
        if seq is None:
            return f"decode worker {self.id} holds no reservation for {header.ident}"
        if sender != seq.task.peer or not proof_matches(seq.kv_secret, sender, header):
            log.warning(
                "refused a KV frame for %s from %r: not from %s with the reservation's secret",
                header.ident,
                sender,
                seq.task.peer,
            )
            return f"{header.ident}: not from its prefill worker with the reservation's secret"
        problem = self.kv_problem(seq, header)
        if problem is not None:
            self.table.remove(seq)
            self.publisher.fail(seq, "kv_rejected", f"the KV frame from {sender} was refused: {problem}", 500)
            self.wake.set()
        return problem

    def kv_problem(self, seq: Sequence, header: Header) -> str | None:
        capacity = self.engine.kv_capacity(seq)
        if header.size > capacity:
            return f"a KV payload of {header.size} bytes is more than the {capacity} bytes reserved"
        return meta_problem(seq.task, header.meta, self.engine.vocab_size)

    async def import_kv(self, sender: str, header: Header, payload: bytes) -> str | None:
        """Transfer-server callback on D, once the payload is in: take the cache and the tokens
        P generated."""
        # Checked again: while the payload came, the request may have been cancelled, or moved
        # here again under a new task and secret.
        refusal = self.admit_kv(sender, header)
        if refusal is not None:
            return refusal
        seq = self.table.get(header.ident, Status.AWAITING_KV)
        assert seq is not None  # admitted just now, with no await between
        self.table.move(seq, Status.IMPORTING)  # held through the import: one entry per request
        error = await self.engine.import_kv(seq, payload)
        if not self.table.remove(seq):  # the request moved here again meanwhile: a newer task has it
            self.publisher.let_go(seq)
            return f"{seq.request_id} moved: a newer task of it is held by decode worker {self.id}"
        if error:
            self.publisher.fail(seq, "kv_import_failed", error, 500)
            return error
        seq.output_ids = list(header.meta["output_token_ids"])
        seq.prompt_cached = header.meta.get("cached_tokens", 0)  # P's prefix cache: the usage reports it
        seq.text.push(seq.output_ids)  # replay: the same text state P had
        self.publisher.writer.open(seq.request_id, reader=seq.request.reader, first_seq=header.meta["next_seq"])
        self.table.add(seq, Status.RUNNING)
        self.wake.set()
        return None

    def expire_waits(self) -> None:
        """Requests whose KV did not come by the kv wait leave; each is failed, or let go if moved."""
        for seq in self.table.kv_waits_past(time.monotonic()):
            self.loops.spawn(self._expire(seq))

    async def _expire(self, seq: Sequence) -> None:
        """No KV came: fail the request, unless it was dispatched again (its new workers answer).
        A task from before hand-off ids: unless the reaper ever moved it."""
        with transient_suppressed("checking for a moved request"):
            if seq.task.handoff:
                moved = bool(dispatched_again(seq, await self.current.read(seq.request_id)))
            else:
                moved = await self.reaping.ever_moved(seq.request_id)
            if moved:
                self.publisher.retire(seq)
                return
        self.publisher.fail(
            seq,
            "kv_transfer_timeout",
            f"no KV cache arrived from {seq.task.peer} within {self.config.kv_wait_s:.0f}s",
            503,
        )
        self.wake.set()
