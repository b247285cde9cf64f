"""The prefill side of the P -> D hand-off, against a real Redis and real transfer sockets."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import WORKER_GROUP
from splitbus.bus.messages import Failed, GenerateRequest, SamplingParams, Task, TokenDelta
from splitbus.bus.records import Reservation
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.bus.reservations import Reservations
from splitbus.redis_server import free_port
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.core import meta_problem
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.kv_proof import Header, proof_matches
from splitbus.worker.sequence import Sequence
from splitbus.worker.table import Status
from splitbus.worker.text import TextStream
from splitbus.worker.transfer import TransferServer
from splitbus.worker.worker import Worker
from tests.worker.replies import add, decoded

SECRET = "the-reservations-secret"


def prefill_worker(bus_config: BusConfig, tiny_model: Path, kv_wait_s: float = 30.0) -> Worker:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(
        bus=bus_config, role="prefill", model_dir=tiny_model, model_name="tiny", worker_id="p1", kv_wait_s=kv_wait_s
    )
    return Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 64, 16))


def prefilled(worker: Worker, request_id: str, peer: str, handoff: str = "h1") -> Sequence:
    """A request P has prefilled: its first token published, its KV ready to ship."""
    request = GenerateRequest(request_id, "tiny", [97, 98], SamplingParams(max_tokens=4), "api", 0)
    seq = Sequence(Task("prefill", request, peer=peer, handoff=handoff), "1-0", TextStream(worker.tokenizer, []))
    worker.writer.open(request_id, reader=request.reader)
    worker.apply([worker.core.emit(seq, 97)])
    worker.requests.add(seq, Status.HANDING_OFF)  # as after_prefill leaves it
    return seq


async def register_decode(worker: Worker, worker_id: str, endpoint: str) -> None:
    """A live decode worker's registry record and lease, as the worker writes them."""
    record = WorkerRecord(worker_id=worker_id, role="decode", model="tiny", transfer_endpoint=endpoint)
    await Registry(worker.redis, worker.config.bus).register(record, lease_ms=30_000)


async def reservation(
    worker: Worker,
    request_id: str,
    decode_worker: str,
    endpoint: str,
    entry: str = "9-0",
    handoff: str = "h1",
    secret: str = SECRET,
    prefill_worker: str = "p1",
) -> None:
    """``sb:kv:{request_id}`` as D writes it (an attacker with Redis access can write the same)."""
    made = Reservation(decode_worker, endpoint, 1, prefill_worker, entry, secret, handoff)
    assert await Reservations(worker.redis, worker.keys).reserve(request_id, made)


class Decoder:
    """The decode side's real TransferServer, taking frames proven with SECRET."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, Header, bytes]] = []
        self.server = TransferServer("d2", self.check, self.take)

    def check(self, sender: str, header: Header) -> str | None:
        return None if proof_matches(SECRET, sender, header) else "no proof"

    async def take(self, sender: str, header: Header, payload: bytes) -> str | None:
        self.frames.append((sender, header, payload))
        return None


class Refuser(Decoder):
    """A live decode side that refuses every frame."""

    def check(self, sender: str, header: Header) -> str | None:
        return "the frame is refused"


class NewerDispatch(Decoder):
    """A live decode side that, as the frame comes, takes a newer dispatch of its request (a new
    reservation, handoff and secret) and so refuses the frame."""

    def __init__(self, bus_config: BusConfig, newer_reservation: bool) -> None:
        super().__init__()
        self.redis, self.refused, self.newer_reservation = (
            redis.Redis.from_url(bus_config.redis_url),
            0,
            newer_reservation,
        )
        self.bus_config, self.current = bus_config, bus_config.keys.current

    def check(self, sender: str, header: Header) -> str | None:
        # The reservation API is async and this check is not: the write runs to its end, on a
        # loop of its own, before the refusal goes out.
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, self.newer_dispatch(header.ident)).result()
        if (
            not self.newer_reservation
        ):  # voided its task; the new reservation is not written yet, the current dispatch is
            self.redis.set(self.current(header.ident), "h2")
        self.refused += 1
        return f"{header.ident}: not from its prefill worker with the reservation's secret"

    async def newer_dispatch(self, request_id: str) -> None:
        client = aioredis.Redis.from_url(self.bus_config.redis_url)
        reservations = Reservations(client, self.bus_config.keys)
        try:
            if self.newer_reservation:
                await reservations.reserve(request_id, Reservation("d2", "", 1, "p1", "5-0", "newer", "h2"))
            else:
                await reservations.drop(request_id, "5-0")
        finally:
            await client.aclose()


class FakeServer:
    """An attacker's listener: counts the connections and bytes that reach it."""

    def __init__(self) -> None:
        self.connections = self.received = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._take, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _take(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.received += len(await reader.read())
        writer.close()


async def close(worker: Worker) -> None:
    await worker.loops.drain()  # the cancel P publishes for a failed hand-off
    await worker.links.client.close()
    await worker.redis.aclose()


async def results(worker: Worker, request_id: str) -> list[object]:
    await worker.publisher.publish()
    return await decoded(worker.redis, worker.keys.out("api", request_id))


async def test_prefill_waits_for_its_peers_reservation_not_a_dead_workers(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    # A request moved off a dead decode worker: that worker's reservation is still in sb:kv
    # when the new prefill task runs. P must wait for the new decode worker's, not send there.
    worker = prefill_worker(bus_config, tiny_model)
    request = GenerateRequest("moved-1", "tiny", [97], SamplingParams(max_tokens=4), "api", 0)
    seq = Sequence(Task("prefill", request, peer="d2", handoff="h1"), "1-0", TextStream(worker.tokenizer, []))
    await reservation(worker, "moved-1", "d1-dead", "127.0.0.1:1", secret="old")
    await register_decode(worker, "d2", "127.0.0.1:2")

    async def new_reservation() -> None:
        await asyncio.sleep(0.2)
        await reservation(worker, "moved-1", "d2", "127.0.0.1:2")

    writer = asyncio.create_task(new_reservation())
    try:
        assert await worker.handoff.wait_for_reservation(seq) == ("127.0.0.1:2", SECRET)
    finally:
        await writer
        await worker.redis.aclose()


@pytest.mark.parametrize("older", [{"handoff": "h0"}, {"prefill_worker": "p0-dead"}])
async def test_prefill_waits_for_its_own_dispatchs_reservation_not_an_older_one(
    bus_config: BusConfig, tiny_model: Path, older: dict[str, str]
) -> None:
    # The same decode worker's reservation, made for an older dispatch of the request (its P
    # died, or the request moved and came back to the same pair): its secret is not this task's,
    # and D would refuse the frame. P waits until D has taken its new task and reserved for it.
    worker = prefill_worker(bus_config, tiny_model)
    seq = prefilled(worker, "again-1", "d2")
    await register_decode(worker, "d2", "127.0.0.1:2")
    await reservation(worker, "again-1", "d2", "127.0.0.1:2", secret="older-secret", **older)

    async def new_reservation() -> None:
        await asyncio.sleep(0.2)
        await reservation(worker, "again-1", "d2", "127.0.0.1:2")

    writer = asyncio.create_task(new_reservation())
    try:
        started = time.monotonic()
        assert await worker.handoff.wait_for_reservation(seq) == ("127.0.0.1:2", SECRET)
        assert time.monotonic() - started >= 0.2  # not the older one, there from the start
    finally:
        await writer
        await close(worker)


async def test_the_kv_goes_to_the_registered_endpoint_with_the_proof(bus_config: BusConfig, tiny_model: Path) -> None:
    worker, decoder = prefill_worker(bus_config, tiny_model), Decoder()
    endpoint = await decoder.server.start("127.0.0.1", 0)
    try:
        await register_decode(worker, "d2", endpoint)
        await reservation(worker, "r-ok", "d2", endpoint)
        seq = prefilled(worker, "r-ok", "d2")
        await worker.handoff.hand_off(seq)
        [(sender, header, payload)] = decoder.frames
        assert (sender, header.ident) == ("p1", "r-ok")
        assert (header.meta["output_token_ids"], header.meta["next_seq"]) == ([97], 1)
        assert isinstance(worker.engine, SimEngine)
        assert payload == worker.engine.kv_payload(seq.request) and worker.outbox.done_entries == ["1-0"]
    finally:
        await decoder.server.close()
        await close(worker)


async def test_a_forged_reservation_endpoint_receives_nothing(bus_config: BusConfig, tiny_model: Path) -> None:
    # The attack: D's reservation is rewritten to point at the attacker's server. P must not
    # send there (nor connect); it waits for D's own endpoint, then fails the request saying why.
    worker, decoder, fake = prefill_worker(bus_config, tiny_model, kv_wait_s=1.0), Decoder(), FakeServer()
    endpoint, forged = await decoder.server.start("127.0.0.1", 0), await fake.start()
    try:
        await register_decode(worker, "d2", endpoint)
        await reservation(worker, "r-forged", "d2", forged)
        await worker.handoff.hand_off(prefilled(worker, "r-forged", "d2"))
        assert (fake.connections, fake.received, decoder.frames) == (0, 0, [])
        assert (
            worker.outbox.done_entries == ["1-0"] and worker.requests.of(Status.HANDING_OFF) == []
        )  # the task is acked at the next publish
        last = (await results(worker, "r-forged"))[-1]
        assert isinstance(last, Failed) and last.code == "kv_transfer_failed"
        assert f"names endpoint '{forged}', not '{endpoint}'" in last.message
    finally:
        await decoder.server.close()
        fake.server.close()
        await close(worker)


async def test_a_reservation_for_an_unregistered_decode_worker_is_not_used(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    # sb:kv alone, with no registry record behind it, sends nothing either.
    worker, fake = prefill_worker(bus_config, tiny_model, kv_wait_s=0.5), FakeServer()
    forged = await fake.start()
    try:
        await worker.redis.set(bus_config.keys.lease("d-ghost"), "1", px=30_000)
        await reservation(worker, "r-ghost", "d-ghost", forged)
        await worker.handoff.hand_off(prefilled(worker, "r-ghost", "d-ghost"))
        assert (fake.connections, fake.received) == (0, 0)
        entries = await results(worker, "r-ghost")
        assert isinstance(entries[0], TokenDelta) and isinstance(entries[-1], Failed)
        assert "names endpoint" in entries[-1].message
    finally:
        fake.server.close()
        await close(worker)


async def test_a_retired_task_drops_only_its_own_reservation(bus_config: BusConfig, tiny_model: Path) -> None:
    # D retires the task of a request that moved here again: the old task's clean-up must not
    # delete the reservation the new task has just written (P would wait for it forever).
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(bus=bus_config, role="decode", model_dir=tiny_model, model_name="tiny", worker_id="d1")
    worker = Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 64, 16))
    moved, done = bus_config.keys.kv("moved-2"), bus_config.keys.kv("done-3")
    try:
        await reservation(worker, "moved-2", "d1", "", entry="2-0")  # the new task's
        await reservation(worker, "done-3", "d1", "", entry="3-0")
        worker.outbox.stale_reservations += [
            ("moved-2", "1-0"),
            ("done-3", "3-0"),
        ]  # the old task of moved-2, and done-3's
        await worker.publisher.publish()
        assert await worker.redis.hget(moved, "task_entry") == b"2-0"
        assert not await worker.redis.exists(done)
        assert worker.outbox.stale_reservations == []
    finally:
        await worker.redis.aclose()


def continued_task(first_seq: int, tokens: list[int], max_tokens: int = 8) -> Task:
    request = GenerateRequest("c1", "tiny", [97], SamplingParams(max_tokens=max_tokens), "api", 0)
    return Task("decode", request, peer="p1", first_seq=first_seq, output_token_ids=tokens)


def test_d_takes_exactly_what_p_could_send_for_a_new_or_a_moved_request() -> None:
    assert meta_problem(continued_task(0, []), {"output_token_ids": [5], "next_seq": 1}, 100) is None
    moved = continued_task(3, [1, 2, 3])  # 3 entries already streamed before its worker died
    assert meta_problem(moved, {"output_token_ids": [1, 2, 3, 4], "next_seq": 4}, 100) is None
    refused = [
        {"output_token_ids": [1, 2, 3, 4], "next_seq": 1},  # would re-send seq 1..3
        {"output_token_ids": [9, 9, 9, 4], "next_seq": 4},  # rewrites tokens already streamed
        {"output_token_ids": [1, 2, 3], "next_seq": 3},  # no new token
        {"output_token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "next_seq": 8},  # max_tokens reached: P would have finished
        {"output_token_ids": [1, 2, 3, 100], "next_seq": 4},  # outside the vocabulary
        {"output_token_ids": [1, 2, 3, True], "next_seq": 4},  # a bool is not a token id
        {"output_token_ids": [1, 2, 3, 4], "next_seq": 4.0},
        {"output_token_ids": "1234", "next_seq": 4},
        {"output_token_ids": [1, 2, 3, 4], "next_seq": 4, "cached_tokens": 2},  # more than the 1-token prompt
        {"output_token_ids": [1, 2, 3, 4], "next_seq": 4, "cached_tokens": -1},
        {"output_token_ids": [1, 2, 3, 4], "next_seq": 4, "cached_tokens": "1"},
    ]
    assert all(meta_problem(moved, meta, 100) for meta in refused)
    assert meta_problem(moved, {"output_token_ids": [1, 2, 3, 4], "next_seq": 4, "cached_tokens": 1}, 100) is None


def test_a_frames_traceparent_is_empty_or_w3cs_like_any_field_of_its_meta() -> None:
    task, meta = continued_task(0, []), {"output_token_ids": [5], "next_seq": 1}
    traced = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert meta_problem(task, {**meta, "traceparent": traced}, 100) is None
    assert meta_problem(task, {**meta, "traceparent": ""}, 100) is None
    for bad in (traced.upper(), traced + "-x", 7, None, "x" * 5000):
        problem = meta_problem(task, {**meta, "traceparent": bad}, 100)
        assert problem is not None and "traceparent" in problem and len(problem) < 200


async def handing_off(worker: Worker, request_id: str, endpoint: str) -> tuple[Sequence, asyncio.Task[None]]:
    """P's hand-off of ``request_id`` to a registered, leased d2 at ``endpoint``, running."""
    await register_decode(worker, "d2", endpoint)
    await reservation(worker, request_id, "d2", endpoint, entry="5-0")
    seq = prefilled(worker, request_id, "d2")
    return seq, asyncio.create_task(worker.handoff.hand_off(seq))


async def reaped(worker: Worker, request_id: str, how: str) -> None:
    """What a reaper leaves once it has taken d2: its record marked dead, or the request's new
    current dispatch (all a worker back from a stop leaves: its lease and record return)."""
    if how == "marked_dead":
        await Registry(worker.redis, worker.config.bus).mark_dead("d2")
    else:
        await worker.redis.set(worker.keys.current(request_id), "h-next")


@pytest.mark.parametrize("how", ["marked_dead", "task_moved"])
async def test_a_dead_decode_workers_request_is_left_to_the_reaper(
    bus_config: BusConfig, tiny_model: Path, how: str
) -> None:
    # Issue 17: D was killed, its lease lives on (3 s). P must neither fail nor cancel the
    # request: it retries while D's fate is undecided, then lets go once a reaper has D.
    worker = prefill_worker(bus_config, tiny_model)
    seq, task = await handing_off(worker, "r-dead", f"127.0.0.1:{free_port()}")  # refused: nobody listens
    try:
        await asyncio.sleep(0.5)
        assert not task.done() and worker.requests.of(Status.HANDING_OFF) == [seq]  # retrying, undecided
        await reaped(worker, "r-dead", how)
        await asyncio.wait_for(task, 5)
        assert worker.outbox.done_entries == ["1-0"] and worker.requests.of(Status.HANDING_OFF) == []
        assert not any(isinstance(e, Failed) for e in await results(worker, "r-dead"))
        assert not await worker.redis.exists(worker.keys.cancel)  # nothing cancelled the request
    finally:
        await close(worker)


async def test_a_hung_decode_worker_is_let_go_once_reaped_not_after_the_transfer_timeout(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    # A stopped D accepts the connection (its kernel does) and never answers: the send would
    # wait its 10 s timeout. P watches D while it waits and lets go soon after the reaper.
    worker = prefill_worker(bus_config, tiny_model)
    hung = await asyncio.start_server(lambda r, w: asyncio.sleep(0), "127.0.0.1", 0)
    seq, task = await handing_off(worker, "r-hung", f"127.0.0.1:{hung.sockets[0].getsockname()[1]}")
    try:
        await asyncio.sleep(0.5)
        assert not task.done()
        reaped_at = time.monotonic()
        await reaped(worker, "r-hung", "task_moved")
        await asyncio.wait_for(task, 5)
        assert time.monotonic() - reaped_at < worker.config.transfer_timeout_s  # a bound: not the timeout
        assert worker.outbox.done_entries == ["1-0"]
        assert not any(isinstance(e, Failed) for e in await results(worker, "r-hung"))
    finally:
        hung.close()
        await close(worker)


async def test_a_live_decode_workers_refusal_ends_the_request(bus_config: BusConfig, tiny_model: Path) -> None:
    # A refusal is an answer from a live peer, not a sign of death: no retry, a clear error.
    worker, decoder = prefill_worker(bus_config, tiny_model), Refuser()
    endpoint = await decoder.server.start("127.0.0.1", 0)
    try:
        seq, task = await handing_off(worker, "r-refused", endpoint)
        await asyncio.wait_for(task, 5)
        last = (await results(worker, "r-refused"))[-1]
        assert isinstance(last, Failed) and last.code == "kv_transfer_failed" and "the frame is refused" in last.message
    finally:
        await decoder.server.close()
        await close(worker)


@pytest.mark.parametrize("newer_reservation", [True, False])
async def test_a_refusal_for_a_newer_dispatch_lets_go_without_an_error(
    bus_config: BusConfig, tiny_model: Path, newer_reservation: bool
) -> None:
    # D refused because, as P sent, it took a newer dispatch of the request (a new reservation
    # and secret, or not yet written but the newer dispatch current): the request is that
    # dispatch's now, so P neither fails nor cancels it (its error and cancel would end it).
    worker, decoder = prefill_worker(bus_config, tiny_model), NewerDispatch(bus_config, newer_reservation)
    endpoint = await decoder.server.start("127.0.0.1", 0)
    try:
        seq, task = await handing_off(worker, "r-newer", endpoint)
        await asyncio.wait_for(task, 5)
        assert decoder.refused == 1
        assert worker.outbox.done_entries == ["1-0"] and worker.requests.of(Status.HANDING_OFF) == []
        assert not any(isinstance(e, Failed) for e in await results(worker, "r-newer"))
        assert not await worker.redis.exists(worker.keys.cancel)
    finally:
        decoder.redis.close()
        await decoder.server.close()
        await close(worker)


@pytest.mark.parametrize("newer_dispatch", [True, False])
async def test_a_request_moved_away_while_a_refusal_is_looked_into_is_retired_once(
    bus_config: BusConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, newer_dispatch: bool
) -> None:
    # After D's refusal, P reads Redis to learn whether the request was dispatched again. If it
    # moved away meanwhile (a worker back from a stop drops what the reaper took), it was retired
    # there: retired again, its task would be acked twice and an error written for a request
    # that is no longer this worker's.
    worker, decoder = prefill_worker(bus_config, tiny_model), Refuser()
    endpoint = await decoder.server.start("127.0.0.1", 0)
    real_superseded = worker.handoff.superseded

    async def moved_meanwhile(seq: Sequence) -> bool:
        answer = await real_superseded(seq)
        worker.apply(worker.core.moved_away(seq))
        return answer or newer_dispatch

    monkeypatch.setattr(worker.handoff, "superseded", moved_meanwhile)
    try:
        await worker.redis.set(worker.keys.current("r-away"), "h1")
        seq, task = await handing_off(worker, "r-away", endpoint)
        await asyncio.wait_for(task, 5)
        assert worker.outbox.done_entries == [seq.entry_id] and worker.requests.of() == []
        assert not any(isinstance(e, Failed) for e in await results(worker, "r-away"))
        assert not await worker.redis.exists(worker.keys.cancel)
    finally:
        await decoder.server.close()
        await close(worker)


async def test_a_refusal_with_the_reservation_gone_still_ends_the_request(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    # A reservation gone is no sign of a newer dispatch (D may have given up waiting): with the
    # request's dispatch still current, the refusal ends it with an error its client sees.
    worker, decoder = prefill_worker(bus_config, tiny_model), Refuser()
    endpoint = await decoder.server.start("127.0.0.1", 0)
    try:
        await worker.redis.set(worker.keys.current("r-gone"), "h1")
        seq, task = await handing_off(worker, "r-gone", endpoint)
        await asyncio.sleep(0)  # the reservation read, the frame on its way
        await Reservations(worker.redis, worker.keys).drop("r-gone", "5-0")  # D gave up on it
        await asyncio.wait_for(task, 5)
        last = (await results(worker, "r-gone"))[-1]
        assert isinstance(last, Failed) and last.code == "kv_transfer_failed"
    finally:
        await decoder.server.close()
        await close(worker)


async def test_an_unreachable_decode_worker_that_keeps_its_lease_fails_at_the_kv_wait(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    # Never reaped (it heartbeats, but its KV port takes nothing): bounded by --kv-wait.
    worker = prefill_worker(bus_config, tiny_model, kv_wait_s=1.0)
    try:
        seq, task = await handing_off(worker, "r-cut", f"127.0.0.1:{free_port()}")
        await asyncio.wait_for(task, 5)
        last = (await results(worker, "r-cut"))[-1]
        assert isinstance(last, Failed) and last.code == "kv_transfer_failed"
        assert "cannot connect" in last.message and "still holds its lease" in last.message
    finally:
        await close(worker)


def decode_worker(bus_config: BusConfig, tiny_model: Path) -> Worker:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(bus=bus_config, role="decode", model_dir=tiny_model, model_name="tiny", worker_id="d-hung")
    return Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 64, 16))


async def decoding(worker: Worker, *request_ids: str) -> list[Sequence]:
    """Tasks read from the worker's own stream (pending to it) and decoding, one token buffered each."""
    await worker.tasks.ensure_group()
    for request_id in request_ids:
        request = GenerateRequest(request_id, "tiny", [97], SamplingParams(max_tokens=8), "api", 0)
        await add(worker.redis, worker.keys.tasks(worker.id), Task("decode", request, peer="p1"))
    seqs = []
    for delivery in await worker.tasks.read(10, block_ms=0):
        assert isinstance(delivery.message, Task)
        seq = Sequence(delivery.message, delivery.entry_id, TextStream(worker.tokenizer, []))
        assert worker.engine.reserve(seq, 32)
        worker.writer.open(seq.request_id, reader=seq.request.reader, first_seq=1)
        worker.apply([worker.core.emit(seq, 97)])  # written after the stop, if at all
        worker.requests.add(seq, Status.RUNNING)
        seqs.append(seq)
    return seqs


async def test_a_worker_back_from_a_stop_drops_what_the_reaper_moved_and_rejoins(
    bus_config: BusConfig, tiny_model: Path
) -> None:
    worker = decode_worker(bus_config, tiny_model)
    try:
        moved, kept = await decoding(worker, "r-moved", "r-kept")
        # While it was stopped: its lease expired, a reaper took it, moved r-moved (acked its
        # task in this worker's stream, as the redispatch script does) and marked it dead.
        await worker.redis.set(worker.keys.reaping(worker.id), "scheduler-1", ex=60)
        await worker.redis.xack(worker.keys.tasks(worker.id), "workers", moved.entry_id)
        await Registry(worker.redis, bus_config).mark_dead(worker.id)
        worker.lease.last_beat = time.monotonic() - 5  # stopped 5 s: past the 3 s lease
        await worker.publisher.publish()  # the first write after waking settles first
        assert worker.requests.of(Status.RUNNING) == [kept] and moved.blocks == 0 and kept.blocks > 0
        assert await worker.redis.xlen(worker.keys.out("api", "r-moved")) == 0  # its late token never went out
        assert await worker.redis.xlen(worker.keys.out("api", "r-kept")) == 1
        record = await worker.redis.hgetall(worker.keys.worker(worker.id))
        assert b"state" not in record and worker.id.encode() in await worker.redis.zrange(worker.keys.workers, 0, -1)
        assert 0 < await worker.redis.ttl(worker.keys.reaping(worker.id)) <= 2  # no reaper takes it again
    finally:
        await worker.redis.aclose()


async def test_a_worker_back_before_any_reaper_keeps_its_requests(bus_config: BusConfig, tiny_model: Path) -> None:
    # Its lease lapsed but no reaper started: it takes sb:reaping:{itself} first, so none can.
    worker = decode_worker(bus_config, tiny_model)
    try:
        seqs = await decoding(worker, "r-1", "r-2")
        worker.lease.last_beat = time.monotonic() - 5
        await worker.publisher.publish()
        assert worker.requests.of(Status.RUNNING) == seqs and not worker.lease.lapsed()
        assert [await worker.redis.xlen(worker.keys.out("api", r)) for r in ("r-1", "r-2")] == [1, 1]
        assert await worker.redis.get(worker.keys.reaping(worker.id)) == b"d-hung:rejoining"
        assert 0 < await worker.redis.ttl(worker.keys.reaping(worker.id)) <= 2
    finally:
        await worker.redis.aclose()


@pytest.mark.parametrize("current", ["h-newer", "h1", None])
async def test_a_decode_task_of_a_replaced_dispatch_reserves_nothing(
    bus_config: BusConfig, tiny_model: Path, current: str | None
) -> None:
    # P died and the reaper moved the request to a new pair before D took its task: nobody
    # will send that task's KV, so D must not hold blocks (and a prefill worker) for it.
    worker = decode_worker(bus_config, tiny_model)
    await worker.tasks.ensure_group()
    request = GenerateRequest("r-void", "tiny", [97], SamplingParams(max_tokens=8), "api", 0)
    await add(worker.redis, worker.keys.tasks(worker.id), Task("decode", request, "p1", handoff="h1"))
    if current is not None:  # none: its current id outlived its TTL, nothing to compare
        await worker.redis.set(worker.keys.current("r-void"), current)
    free = worker.engine.free_blocks
    try:
        await worker.feed.feed_tasks()
        reserved = await worker.redis.hgetall(worker.keys.kv("r-void"))
        if current == "h-newer":
            assert reserved == {} and worker.requests.of(Status.AWAITING_KV) == [] and worker.engine.free_blocks == free
            await worker.publisher.publish()
            assert (await worker.redis.xpending(worker.keys.tasks(worker.id), WORKER_GROUP))["pending"] == 0
            assert await worker.redis.xlen(worker.keys.out("api", "r-void")) == 0  # no error: the request lives on
        else:
            assert reserved[b"handoff"] == b"h1" and [s.request_id for s in worker.requests.of(Status.AWAITING_KV)] == [
                "r-void"
            ]
    finally:
        await worker.redis.aclose()


async def test_a_bug_in_a_hand_off_fails_that_request_alone(
    bus_config: BusConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An unexpected error while shipping (here the engine's export) must not leave the task
    # unacked and its blocks held forever: the request fails with its reason, the worker goes on.
    worker, decoder = prefill_worker(bus_config, tiny_model), Decoder()
    endpoint = await decoder.server.start("127.0.0.1", 0)

    async def broken_export(seq: Sequence) -> bytes:
        raise RuntimeError("export broke")

    monkeypatch.setattr(worker.engine, "export_kv", broken_export)
    try:
        seq, task = await handing_off(worker, "r-bug", endpoint)
        await asyncio.wait_for(task, 5)
        last = (await results(worker, "r-bug"))[-1]
        assert isinstance(last, Failed) and last.code == "handler_failed" and "export broke" in last.message
        assert (
            worker.outbox.done_entries == [] and worker.requests.of(Status.HANDING_OFF) == []
        )  # acked at that publish
    finally:
        await decoder.server.close()
        await close(worker)
