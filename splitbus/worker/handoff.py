"""The P -> D hand-off, prefill side: ship a prefilled request's KV cache to the decode worker
its task names, then let go of the request (ack its task) or fail it.

A dead or hung decode worker does not fail the request: once a reaper has decided it gone, the
request is the reaper's (it gets a new P/D pair, prefilled again), and P only lets go. A refusal
by a live decode worker, a forged reservation or the kv wait deadline fails it, saying why.

The decode side checks a frame's meta with :func:`meta_problem`: exactly what the prefill worker
its task names could have sent. P prefills once and publishes one entry (its first token), so its
frame carries the tokens the task already had plus the ones P made, and the ``seq`` D continues
at: the task's ``first_seq`` plus one per new token. Anything else is not a frame P sent, and D
would hang the stream (a ``seq`` gap), crash (a negative one) or decode nonsense if it took it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from splitbus.bus.core.aio import cancel_and_wait
from splitbus.bus.core.connection import is_transient, transient_suppressed
from splitbus.bus.dispatch import CurrentDispatch
from splitbus.bus.messages import Task
from splitbus.bus.registry import Registry
from splitbus.bus.reservations import Reservation, Reservations
from splitbus.worker import metrics
from splitbus.worker.cancellation import Cancellation
from splitbus.worker.links import PeerLinks
from splitbus.worker.publisher import Publisher
from splitbus.worker.requests import Status
from splitbus.worker.sequence import Sequence
from splitbus.worker.shared import Shared
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
        shared: Shared,
        publisher: Publisher,
        cancellation: Cancellation,
        links: PeerLinks,
        lapsed: Callable[[], bool],
    ) -> None:
        self.config, self.id, self.redis, self.keys = shared.config, shared.id, shared.redis, shared.config.bus.keys
        self.table, self.engine, self.wake = shared.table, shared.engine, shared.wake
        self.publisher, self.cancellation, self.links, self.lapsed = publisher, cancellation, links, lapsed
        self.reservations = Reservations(self.redis, self.keys)
        self.registry = Registry(self.redis, shared.config.bus)
        self.current = CurrentDispatch(self.redis, self.keys)

    async def hand_off(self, seq: Sequence) -> None:
        """Ship the cache, then ack (or fail) the task; the request leaves the table."""
        try:
            await self._settle(seq, await self._ship(seq))
        finally:
            if self.table.holds(seq, Status.HANDING_OFF):
                self.table.remove(seq)
            seq.kv = None
            self.wake.set()

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
        if isinstance(exc, Abandoned) or not self.table.holds(seq, Status.HANDING_OFF):
            return  # moved away or voided meanwhile (retired there)
        if exc is None:
            self.publisher.retire(seq)
        elif isinstance(exc, PeerGone):
            log.warning("%s; leaving %s to the reaper", exc, seq.request_id)
            self.publisher.retire(seq)
        elif isinstance(exc, (TransferError, asyncio.TimeoutError)):
            await self.transfer_failed(seq, exc)
        else:
            self.publisher.fail(seq, "handler_failed", f"the KV hand-off failed: {type(exc).__name__}: {exc}", 500)

    async def ship_kv(self, seq: Sequence) -> None:
        """Send the KV; a failure at the connection level (refused, reset, closed, no answer) is
        tried again with capped backoff while the decode worker's liveness is undecided, until
        ``kv_wait``. PeerGone once it is decided dead; TransferError for a refusal by a live one."""
        deadline, delay = time.monotonic() + self.config.kv_wait_s, RETRY_FIRST_S
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
            "next_seq": self.publisher.writer.next_seq(seq.request_id),
            "cached_tokens": min(seq.prompt_cached, seq.prompt_len),  # for the usage D reports
        }
        with metrics.KV_TRANSFER.time():
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
        if seq.request_id in self.cancellation:
            raise TransferError("the request was cancelled")
        gone = await self.peer_gone(seq)
        if gone:
            raise PeerGone(gone)
        if time.monotonic() > deadline:
            waited = f"retried for {self.config.kv_wait_s:.0f}s"
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

    async def transfer_failed(self, seq: Sequence, exc: Exception) -> None:
        """A failure not about the decode worker's death (a refusal by a live one, a bad
        reservation, the kv wait deadline) ends the request with an error, and cancels it;
        unless the request belongs to a newer dispatch now (its error and cancel would end that
        one): then P only lets go."""
        superseded = await self.superseded(seq)
        if not self.table.holds(seq, Status.HANDING_OFF):
            return  # moved away while Redis answered: retired there
        if superseded:
            log.warning("hand-off of %s failed (%s), but it was dispatched again; leaving it", seq.request_id, exc)
            self.publisher.retire(seq)
            return
        self.publisher.fail(seq, "kv_transfer_failed", f"could not hand the KV cache to {seq.task.peer}: {exc}", 503)
        self.cancellation.cancel_peer(seq, "kv_transfer_failed")

    async def wait_for_reservation(self, seq: Sequence) -> tuple[str, str]:
        """D's transfer endpoint and the reservation's secret, once D has reserved blocks.

        The endpoint is the one in D's own registry record, never one read from ``sb:kv``
        alone: a reservation naming another endpoint (forged, or a stale one) would have P send
        the request's KV to whoever listens there, so it is not taken; P waits on for D's own
        until ``kv_wait``, then fails the request saying why."""
        deadline = time.monotonic() + self.config.kv_wait_s
        delay, mismatch = 0.002, ""
        while time.monotonic() < deadline:
            reservation, registered, peer_alive, current = await self._read_reservation(seq)
            # Only the reservation of this task's own dispatch: a request moved (off a dead
            # decode worker, or a dead prefill worker) still finds the older dispatch's one
            # here until its decode worker replaces it, and its secret is not this task's.
            if reservation is not None and self.reserved_for(seq, reservation) and reservation.secret:
                endpoint, secret = reservation.endpoint, reservation.secret
                if endpoint and endpoint == registered:
                    log.debug("found %s's reservation for %s; sending to %s", seq.task.peer, seq.request_id, endpoint)
                    return registered, secret
                mismatch = mismatch or self._endpoint_mismatch(seq, endpoint, registered)
            gone = dispatched_again(seq, current) or (None if peer_alive else await self.peer_gone(seq))
            if gone:
                raise PeerGone(gone)
            if seq.request_id in self.cancellation:
                raise TransferError("the request was cancelled")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        waited = f"decode worker {seq.task.peer} reserved no KV blocks within {self.config.kv_wait_s:.0f}s"
        raise TransferError(mismatch or waited)

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


def dispatched_again(seq: Sequence, current: bytes | str | None) -> str | None:
    """Why this task is void, given its request's current hand-off id: a reaper moved the
    request to another pair. (No id: a task from before hand-off ids, or a current id that
    outlived its TTL; nothing newer is known.)"""
    if isinstance(current, str):  # a client that decodes replies (these do not)
        current = current.encode()
    if seq.task.handoff and current is not None and current != seq.task.handoff.encode():
        return f"{seq.request_id} was dispatched again (the reaper moved it off {seq.task.peer} or this worker)"
    return None


def meta_problem(task: Task, meta: dict[str, Any], vocab_size: int) -> str | None:
    """Why ``meta`` cannot be the hand-off of ``task``'s request, or None."""
    tokens = meta.get("output_token_ids")
    problem = _tokens_problem(task, tokens, vocab_size)
    if problem is not None:
        return problem
    assert isinstance(tokens, list)
    expected = task.first_seq + len(tokens) - len(task.output_token_ids)
    next_seq = meta.get("next_seq")
    if type(next_seq) is not int or next_seq != expected:
        return f"next_seq must be {expected} (one entry per token after first_seq {task.first_seq}), got {next_seq!r}"
    cached, prompt = meta.get("cached_tokens", 0), len(task.request.prompt_token_ids)
    if type(cached) is not int or not 0 <= cached <= prompt:
        return f"cached_tokens must be an integer in [0, {prompt}], got {cached!r:.40}"
    return None


def _tokens_problem(task: Task, tokens: Any, vocab_size: int) -> str | None:
    before, max_tokens = task.output_token_ids, task.request.sampling.max_tokens
    if type(tokens) is not list or not tokens:
        return "output_token_ids must be a non-empty list of token ids"
    if not len(before) < len(tokens) < max_tokens:
        # P hands off only an unfinished request, so it sent fewer than max_tokens tokens.
        return f"output_token_ids holds {len(tokens)} tokens; expected {len(before) + 1} to {max_tokens - 1}"
    if any(type(t) is not int or not 0 <= t < vocab_size for t in tokens):
        return f"output_token_ids must hold integers in [0, {vocab_size})"
    if tokens[: len(before)] != before:
        return "output_token_ids must start with the task's own output_token_ids"
    return None
