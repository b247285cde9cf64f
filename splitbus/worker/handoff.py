"""The P -> D hand-off, prefill side: ship a prefilled request's KV cache to the decode worker
its task names, then let go of the request (ack its task) or fail it.

A dead or hung decode worker does not fail the request: once a reaper has decided it gone, the
request is the reaper's (it gets a new P/D pair, prefilled again), and P only lets go. A refusal
by a live decode worker, a forged reservation or the kv wait deadline fails it, saying why.

What the request's table entry becomes is the core's (``WorkerCore.hand_off_outcome``,
``hand_off_ended``); this module does the I/O: the reservation's read, the connection, the send,
and the checks of the decode worker's liveness in Redis. The decode side checks a frame's meta
with ``splitbus.worker.core.meta_problem``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from splitbus import tracing
from splitbus.bus.core.aio import cancel_and_wait
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import is_transient, transient_suppressed
from splitbus.bus.dispatch import CurrentDispatch
from splitbus.bus.records import Reservation
from splitbus.bus.registry import Registry
from splitbus.bus.reservations import Reservations
from splitbus.bus.results import ResultWriter
from splitbus.worker import metrics, spans
from splitbus.worker.core import HandOffEnd, WorkerCore, dispatched_again
from splitbus.worker.effects import Apply
from splitbus.worker.links import PeerLinks
from splitbus.worker.sequence import Sequence
from splitbus.worker.table import Status
from splitbus.worker.transfer import TransferError, Unreachable

log = logging.getLogger(__name__)
RETRY_FIRST_S = 0.02
RETRY_MAX_S = 0.5
"""Backoff between hand-off attempts to a decode worker that does not answer (capped)."""
LIVENESS_POLL_S = 0.25
"""While a transfer waits on its decode worker, how often P checks whether that worker is gone."""


class PeerGone(Exception):
    """The decode worker of a hand-off is dead, or the request moved: the reaper has it."""


class Abandoned(Exception):
    """The hand-off's request left this worker while it was being shipped (it moved)."""


class HandOff:
    """The prefill side's hand-offs: ``hand_off(seq)`` runs as one-shot work per prefilled
    request (``seq`` HANDING_OFF in the table) and contains its own failures."""

    def __init__(
        self,
        core: WorkerCore,
        redis: aioredis.Redis,
        bus: BusConfig,
        links: PeerLinks,
        writer: ResultWriter,
        *,
        apply: Apply,
        lapsed: Callable[[], bool],
    ) -> None:
        self.core, self.id, self.table, self.engine = core, core.id, core.table, core.engine
        self.kv_wait_s = core.limits.kv_wait_s
        self.redis, self.links, self.writer, self.apply, self.lapsed = redis, links, writer, apply, lapsed
        self.reservations = Reservations(redis, bus.keys)
        self.registry = Registry(redis, bus)
        self.current = CurrentDispatch(redis, bus.keys)

    async def hand_off(self, seq: Sequence) -> None:
        """Ship the cache, then ack (or fail) the task; the request leaves the table."""
        try:
            await self._settle(seq, await self._ship(seq))
        finally:
            self.apply(self.core.hand_off_ended(seq))

    async def _ship(self, seq: Sequence) -> Exception | None:
        """``ship_kv``; the exception that ended it, or None once D has the cache."""
        try:
            await self.ship_kv(seq)
        except (Abandoned, PeerGone, TransferError, asyncio.TimeoutError) as exc:
            return exc
        except Exception as exc:  # a bug: this request alone fails (its task acked), the worker goes on
            log.exception("hand-off of %s failed", seq.request_id)
            return exc
        return None

    async def _settle(self, seq: Sequence, exc: Exception | None) -> None:
        """What the hand-off's end comes to is the core's (``WorkerCore.hand_off_outcome``); a
        refusal first asks Redis whether the request was dispatched again (``superseded``)."""
        if isinstance(exc, Abandoned) or not self.table.holds(seq, Status.HANDING_OFF):
            return  # moved away or voided meanwhile (retired there)
        end = _end_of(exc)
        superseded = end is HandOffEnd.REFUSED and await self.superseded(seq)
        self.apply(self.core.hand_off_outcome(seq, end, exc, superseded=superseded))

    async def ship_kv(self, seq: Sequence) -> None:
        """Send the KV; a failure at the connection level (refused, reset, closed, no answer) is
        tried again with capped backoff while the decode worker's liveness is undecided, until
        ``kv_wait``. PeerGone once it is decided dead; TransferError for a refusal by a live one."""
        deadline, delay = time.monotonic() + self.kv_wait_s, RETRY_FIRST_S
        while True:
            try:
                endpoint, secret = await self.wait_for_reservation(seq)
                return await self.watched(seq, self.send_kv(seq, endpoint, secret))
            except Unreachable as exc:
                problem: Exception = exc
            except Exception as exc:
                if not is_transient(exc):  # Redis refusing for now: the same as no answer
                    raise
                problem = exc
            await self.still_undecided(seq, problem, deadline)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def send_kv(self, seq: Sequence, endpoint: str, secret: str) -> None:
        await self.links.ensure(seq.task.peer, endpoint)
        meta = {
            "output_token_ids": seq.output_ids,
            "next_seq": self.writer.next_seq(seq.request_id),
            "cached_tokens": min(seq.prompt_cached, seq.prompt_len),  # for the usage D reports
        }
        with metrics.KV_TRANSFER.time(), spans.kv_transfer(seq, meta) if tracing.on else contextlib.nullcontext():
            payload = await self.engine.export_kv(seq)
            self.check_still_mine(seq)  # a worker back from a stop must not ship a moved request
            await self.links.client.send(endpoint, seq.request_id, meta, payload, secret)
        metrics.KV_TRANSFER_BYTES.inc(len(payload))

    def check_still_mine(self, seq: Sequence) -> None:
        if not self.table.holds(seq, Status.HANDING_OFF):
            raise Abandoned(seq.request_id)
        if self.lapsed():
            raise Unreachable("this worker's own lease lapsed: it sends nothing until it has rejoined")

    async def watched(self, seq: Sequence, work: Awaitable[None]) -> None:
        """Run ``work`` (a connect and send) while checking that the decode worker lives: a
        hung one holds the connection open without answering, and the transfer would otherwise
        wait its whole timeout (10 s) after the reaper has moved the request."""
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait({task}, timeout=LIVENESS_POLL_S))[0]:
                gone = await self.peer_gone(seq)
                if gone:
                    raise PeerGone(gone)
            return task.result()
        finally:
            await cancel_and_wait({task})

    async def still_undecided(self, seq: Sequence, exc: Exception, deadline: float) -> None:
        """After a failed attempt: PeerGone if the decode worker is decided gone; TransferError
        past the deadline (it holds its lease but takes no connection); else back to retrying."""
        if not self.table.holds(seq, Status.HANDING_OFF):
            raise Abandoned(seq.request_id)
        if seq.request_id in self.core.cancelled:
            raise TransferError("the request was cancelled")
        gone = await self.peer_gone(seq)
        if gone:
            raise PeerGone(gone)
        if time.monotonic() > deadline:
            waited = f"retried for {self.kv_wait_s:.0f}s"
            raise TransferError(f"{exc}; {seq.task.peer} still holds its lease, {waited}")
        log.info(
            "hand-off of %s to %s failed (%s); retrying while its liveness is undecided",
            seq.request_id,
            seq.task.peer,
            exc,
        )

    async def peer_gone(self, seq: Sequence) -> str | None:
        """Why the request's decode side is decided gone, or None while undecided: a reaper
        marked the decode worker dead, or dispatched the request again (a worker back from a
        stop has its lease and record again, but the request's current dispatch is not this
        task's). An expired lease alone is not enough: until a reaper takes the worker, it may
        come back and keep its tasks (docs/reliability.md). Redis refusing: undecided."""
        with transient_suppressed("checking a decode worker's liveness"):
            pipe = self.redis.pipeline(transaction=False)
            self.registry.queue_dead(pipe, seq.task.peer)
            self.current.queue_read(pipe, seq.request_id)
            state, current = await pipe.execute()
            if self.registry.dead(state):
                return f"decode worker {seq.task.peer} is dead (reaped)"
            return dispatched_again(seq, self.current.parse(current))
        return None

    async def wait_for_reservation(self, seq: Sequence) -> tuple[str, str]:
        """D's transfer endpoint and the reservation's secret, once D has reserved blocks.

        The endpoint is the one in D's own registry record, never one read from ``sb:kv``
        alone: a reservation naming another endpoint (forged, or a stale one) would have P send
        the request's KV to whoever listens there, so it is not taken; P waits on for D's own
        until ``kv_wait``, then fails the request saying why."""
        deadline = time.monotonic() + self.kv_wait_s
        delay, mismatch = 0.002, ""
        while time.monotonic() < deadline:
            reservation, registered, peer_alive, current = await self._read_reservation(seq)
            usable = self.usable(seq, reservation)
            if usable is not None and usable.endpoint and usable.endpoint == registered:
                log.debug("found %s's reservation for %s; sending to %s", seq.task.peer, seq.request_id, registered)
                return registered, usable.secret
            if usable is not None:
                mismatch = mismatch or self._endpoint_mismatch(seq, usable.endpoint, registered)
            await self.check_waiting(seq, current, peer_alive)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        waited = f"decode worker {seq.task.peer} reserved no KV blocks within {self.kv_wait_s:.0f}s"
        raise TransferError(mismatch or waited)

    def usable(self, seq: Sequence, reservation: Reservation | None) -> Reservation | None:
        """The reservation if it is of this task's own dispatch, with a secret. A request moved
        (off a dead decode worker, or a dead prefill worker) still finds the older dispatch's
        one until its decode worker replaces it, and its secret is not this task's."""
        if reservation is not None and self.reserved_for(seq, reservation) and reservation.secret:
            return reservation
        return None

    async def check_waiting(self, seq: Sequence, current: bytes | None, peer_alive: bool) -> None:
        """While P waits for a reservation: PeerGone once the request is the reaper's, a
        TransferError once it was cancelled."""
        gone = dispatched_again(seq, current) or (None if peer_alive else await self.peer_gone(seq))
        if gone:
            raise PeerGone(gone)
        if seq.request_id in self.core.cancelled:
            raise TransferError("the request was cancelled")

    async def superseded(self, seq: Sequence) -> bool:
        """Whether the request now belongs to another dispatch: ``sb:current`` names another, or
        D's reservation was made for another (D took the newer task first). A reservation gone
        proves nothing (D may have given up on it); Redis refusing: not known, so no."""
        with transient_suppressed("reading a KV reservation"):
            reservation, _, _, current = await self._read_reservation(seq)
            handoff = reservation.handoff if reservation is not None else ""
            return bool(dispatched_again(seq, current)) or bool(handoff and handoff != seq.task.handoff)
        return False

    def reserved_for(self, seq: Sequence, reservation: Reservation) -> bool:
        """Whether a reservation's (decode_worker, prefill_worker, handoff) are this task's."""
        return reservation.made_for(seq.task.peer, self.id, seq.task.handoff)

    async def _read_reservation(self, seq: Sequence) -> tuple[Reservation | None, str, bool, bytes | None]:
        """(sb:kv's reservation, if a valid one; D's registered endpoint; whether D is alive;
        the request's current hand-off id), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        self.reservations.queue_read(pipe, seq.request_id)
        self.registry.queue_endpoint_and_lease(pipe, seq.task.peer)
        self.current.queue_read(pipe, seq.request_id)
        reservation, registered, peer_alive, current = await pipe.execute()
        endpoint = self.registry.endpoint(registered)
        return (
            self.reservations.parse(seq.request_id, reservation),
            endpoint,
            bool(peer_alive),
            self.current.parse(current),
        )

    def _endpoint_mismatch(self, seq: Sequence, endpoint: str, registered: str) -> str:
        why = (
            f"the KV reservation for {seq.request_id} names endpoint {endpoint!r}, not {registered!r} from "
            f"{seq.task.peer}'s registry record; nothing was sent there"
        )
        log.warning("%s (forged or stale reservation); waiting for %s's own", why, seq.task.peer)
        return why


def _end_of(exc: Exception | None) -> HandOffEnd:
    """How ``HandOff.ship_kv`` ended, from what it raised (None: it shipped)."""
    if exc is None:
        return HandOffEnd.SHIPPED
    if isinstance(exc, PeerGone):
        return HandOffEnd.PEER_GONE
    if isinstance(exc, (TransferError, asyncio.TimeoutError)):
        return HandOffEnd.REFUSED
    return HandOffEnd.BROKEN
