"""The KV transfer protocol over real loopback sockets: frames, proofs, and what a receiver
refuses before it reads a payload."""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any

import orjson
import pytest

from splitbus.redis_server import free_port
from splitbus.worker.kv_proof import Header, kv_proof, proof_matches
from splitbus.worker.transfer import (
    ACK,
    HEADER,
    HELLO,
    KV,
    MAGIC,
    MAX_PAYLOAD,
    MAX_SKIP,
    Refused,
    TransferClient,
    TransferError,
    TransferServer,
    Unreachable,
    read_frame,
    write_frame,
)

SECRET = "s3cret"


class Receiver:
    """A decode side that takes frames proven with SECRET for requests it knows, up to a size."""

    def __init__(self, known: set[str], max_size: int = 1 << 24) -> None:
        self.known, self.max_size = known, max_size
        self.checked: list[tuple[str, Header]] = []
        self.received: dict[str, tuple[dict[str, Any], bytes]] = {}

    def check(self, sender: str, header: Header) -> str | None:
        self.checked.append((sender, header))
        if header.ident not in self.known:
            return "no reservation"
        if not proof_matches(SECRET, sender, header):
            return "no proof"
        return "too large" if header.size > self.max_size else None

    async def take(self, sender: str, header: Header, payload: bytes) -> str | None:
        self.received[header.ident] = (header.meta, payload)
        return None


async def serve(receiver: Receiver) -> tuple[TransferServer, str]:
    server = TransferServer("d1", receiver.check, receiver.take)
    return server, await server.start("127.0.0.1", 0)


async def open_hello(endpoint: str, sender: str = "p1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = endpoint.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    await write_frame(writer, HELLO, sender, {})
    assert (await read_frame(reader)).meta["ok"] is True
    return reader, writer


async def closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes the connection (bounded: a server that reads on fails the test)."""
    return await asyncio.wait_for(reader.read(), 10)


async def test_kv_arrives_intact_and_small_refusals_keep_the_connection() -> None:
    receiver = Receiver({"r1", "r2"})
    server, endpoint = await serve(receiver)
    client = TransferClient("p1", timeout_s=5)
    payload = bytes(range(256)) * 4096  # 1 MiB
    await client.send(endpoint, "r1", {"next_seq": 1}, memoryview(payload), SECRET)
    meta, got = receiver.received["r1"]
    assert got == payload and meta["next_seq"] == 1 and isinstance(meta["proof"], str)
    with pytest.raises(Refused, match="no reservation"):
        await client.send(endpoint, "unknown", {}, b"x", SECRET)
    with pytest.raises(Refused, match="no proof"):
        await client.send(endpoint, "r2", {}, b"x", "a guess")
    assert client.connected(endpoint)
    await client.send(endpoint, "r2", {}, b"", SECRET)
    assert "r2" in receiver.received and "unknown" not in receiver.received
    await client.close()
    await server.close()


def test_the_proof_covers_sender_request_meta_size_and_crc() -> None:
    meta = {"next_seq": 3, "output_token_ids": [1, 2]}
    header = Header(KV, "r1", {**meta, "proof": kv_proof(SECRET, "p1", "r1", meta, 10, 99)}, 10, 99)
    assert proof_matches(SECRET, "p1", header)
    changed = [
        Header(KV, "r2", header.meta, 10, 99),
        Header(KV, "r1", {**header.meta, "next_seq": 4}, 10, 99),
        Header(KV, "r1", {**header.meta, "output_token_ids": [1, 3]}, 10, 99),
        Header(KV, "r1", header.meta, 11, 99),
        Header(KV, "r1", header.meta, 10, 98),
        Header(KV, "r1", {**meta, "proof": "ü" * 64}, 10, 99),  # not ASCII: refused, not a TypeError
        Header(KV, "r1", meta, 10, 99),  # no proof at all
    ]
    assert not any(proof_matches(SECRET, "p1", h) for h in changed)
    assert not proof_matches(SECRET, "p2", header) and not proof_matches("other", "p1", header)
    empty = kv_proof("", "p1", "r1", meta, 10, 99)
    assert not proof_matches("", "p1", Header(KV, "r1", {**meta, "proof": empty}, 10, 99))  # no secret: nothing matches


async def test_unreachable_endpoint_is_a_transfer_error() -> None:
    with pytest.raises(Unreachable, match="cannot connect"):  # "the peer may be dead": P retries
        await TransferClient("p1", timeout_s=2).connect(f"127.0.0.1:{free_port()}")


async def test_a_peer_that_dies_or_hangs_is_unreachable_and_a_refusal_is_not() -> None:
    # What P retries (the peer may be dead) and what ends the request (a live peer said no).
    receiver = Receiver({"r1"})
    server, endpoint = await serve(receiver)
    client = TransferClient("p1", timeout_s=0.5)
    with pytest.raises(Refused) as refused:
        await client.send(endpoint, "unknown", {}, b"x", SECRET)
    assert not isinstance(refused.value, Unreachable)
    reset = await asyncio.start_server(lambda r, w: w.transport.abort(), "127.0.0.1", 0)  # an RST at once
    closing = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)  # a FIN at once
    hung = await asyncio.start_server(lambda r, w: asyncio.sleep(0), "127.0.0.1", 0)  # accepts, never answers
    for stub in (reset, closing, hung):
        with pytest.raises(Unreachable, match="transfer to .* failed"):
            await client.send(f"127.0.0.1:{stub.sockets[0].getsockname()[1]}", "r1", {}, b"x", SECRET)
        stub.close()
    await client.close()
    await server.close()


async def test_corrupt_frame_is_rejected() -> None:
    receiver = Receiver({"r"})
    server, endpoint = await serve(receiver)
    reader, writer = await open_hello(endpoint)
    meta = {"proof": kv_proof(SECRET, "p1", "r", {}, 3, 12345)}
    await write_frame(writer, KV, "r", meta, b"abc", crc=12345)  # proven, but the bytes do not match the CRC
    assert await closed(reader) == b""  # the server drops a connection that sends garbage
    assert receiver.received == {}
    writer.close()
    await server.close()
    assert struct.calcsize("!4sBHIQI") == HEADER.size


@pytest.mark.parametrize(
    "first",
    [
        HEADER.pack(MAGIC, KV, 1, 2, 0, 0) + b"r{}",  # KV before any HELLO
        HEADER.pack(b"HTTP", HELLO, 2, 2, 0, 0) + b"p1{}",
        HEADER.pack(MAGIC, HELLO, 2, 2, 5, 0) + b"p1{}",  # a HELLO with a payload
        HEADER.pack(MAGIC, HELLO, 2, 4, 0, 0) + b"p1\xff{}\x00",  # meta that is not JSON
    ],
)
async def test_a_connection_must_open_with_a_plain_hello(first: bytes) -> None:
    receiver = Receiver({"r"})
    server, endpoint = await serve(receiver)
    host, port = endpoint.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(first)
    await writer.drain()
    assert await closed(reader) == b""
    assert receiver.checked == []
    writer.close()
    await server.close()


@pytest.mark.parametrize("size", [MAX_PAYLOAD, (1 << 24) + 1])
async def test_a_huge_declared_payload_is_refused_before_it_is_read(size: int) -> None:
    # 64 GiB, or just past what the receiver allows: the receiver answers from the header and
    # closes; it never waits for (or allocates) the payload, which is never sent here.
    receiver = Receiver({"r"})
    server, endpoint = await serve(receiver)
    reader, writer = await open_hello(endpoint)
    meta = {"proof": kv_proof(SECRET, "p1", "r", {}, size, 0)}
    name, info = b"r", orjson.dumps(meta)
    writer.write(HEADER.pack(MAGIC, KV, len(name), len(info), size, 0) + name + info)  # the header only
    await writer.drain()
    ack = await asyncio.wait_for(read_frame(reader), 10)
    assert ack.kind == ACK and ack.meta["ok"] is False and ack.meta["error"] == "too large"
    assert await closed(reader) == b""
    assert receiver.checked[-1][1].size == size and receiver.received == {}
    writer.close()
    await server.close()


async def test_a_payload_over_the_protocol_limit_closes_at_once() -> None:
    receiver = Receiver({"r"})
    server, endpoint = await serve(receiver)
    reader, writer = await open_hello(endpoint)
    writer.write(HEADER.pack(MAGIC, KV, 1, 2, MAX_PAYLOAD + 1, 0) + b"r{}")
    await writer.drain()
    assert await closed(reader) == b""  # not even asked: no frame is that large
    assert receiver.checked == []
    writer.close()
    await server.close()


async def test_a_refused_large_frame_drops_the_clients_connection() -> None:
    receiver = Receiver({"r"}, max_size=10)
    server, endpoint = await serve(receiver)
    client = TransferClient("p1", timeout_s=5)
    with pytest.raises(TransferError):  # Refused, or the reset of a connection closed mid-payload
        await client.send(endpoint, "r", {}, b"\0" * (MAX_SKIP + 1), SECRET)
    assert not client.connected(endpoint)
    await client.send(endpoint, "r", {}, b"12345", SECRET)  # a fresh connection serves the next
    assert receiver.received["r"][1] == b"12345"
    await client.close()
    await server.close()


async def test_a_silent_connection_is_closed() -> None:
    """A stranger that connects and sends no HELLO in time is closed: it cannot hold a socket."""
    receiver = Receiver({"r"})
    server = TransferServer("d1", receiver.check, receiver.take, hello_timeout_s=0.3)
    host, port = (await server.start("127.0.0.1", 0)).split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    assert await closed(reader) == b""
    writer.close()
    await server.close()


async def test_a_full_port_closes_new_connections_and_serves_again_once_one_ends() -> None:
    receiver = Receiver({"r"})
    server = TransferServer("d1", receiver.check, receiver.take, hello_timeout_s=60, max_connections=2)
    endpoint = await server.start("127.0.0.1", 0)
    host, port = endpoint.split(":")
    silent = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
    extra_reader, extra_writer = await asyncio.open_connection(host, int(port))
    assert await closed(extra_reader) == b""  # over the cap: closed at once, not after the 60 s timeout
    extra_writer.close()
    silent[0][1].close()
    await asyncio.wait_for(_until(lambda: server.open_connections == 1), 10)
    client = TransferClient("p1", timeout_s=5)
    await client.send(endpoint, "r", {}, b"kv", SECRET)
    assert receiver.received["r"][1] == b"kv"
    await client.close()
    silent[1][1].close()
    await server.close()


def test_a_stopping_server_ends_its_connections_and_logs_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A decode worker stopping while prefill workers hold their connections (one idle after its
    HELLO, one mid-header): the server ends them, and when the event loop ends (asyncio.run, as
    the worker's) no handler is left for it to cancel. A cancelled handler was logged as an
    asyncio CancelledError traceback on Ctrl-C of `splitbus up`."""

    async def main() -> None:
        server, endpoint = await serve(Receiver({"r"}))
        idle_reader, _idle = await open_hello(endpoint)
        mid_reader, mid_writer = await open_hello(endpoint, "p2")
        mid_writer.write(HEADER.pack(MAGIC, KV, 1, 2, 0, 0)[:10])
        await mid_writer.drain()
        await _until(lambda: server.open_connections == 2)
        await server.close()
        assert server.open_connections == 0
        assert await _ended(idle_reader) and await _ended(mid_reader)
        # the clients' writers stay open: the prefill workers have not stopped yet

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def _ended(reader: asyncio.StreamReader) -> bool:
    """The server closed the connection: an end of stream, or a reset if it left bytes unread."""
    try:
        return await closed(reader) == b""
    except ConnectionResetError:
        return True


async def _until(done: Any) -> None:
    while not done():
        await asyncio.sleep(0.01)


def test_meta_too_deep_to_sign_is_no_proof_not_a_crash() -> None:
    deep: Any = {}
    for _ in range(300):  # orjson parses 1024 levels but signs only 254
        deep = {"d": deep}
    header = Header(KV, "r", {"proof": "x", "deep": deep}, 0, 0)
    assert proof_matches(SECRET, "p1", header) is False


def test_transfers_queued_on_a_link_that_fails_are_unreachable_not_a_crash() -> None:
    """Two hand-offs to one decode worker share its link; the first finds it dead and drops it,
    and the second, queued on the link's lock, used to write on the closed transport: uvloop (the
    workers' loop) raised a RuntimeError, and the request failed instead of being retried."""
    import uvloop

    async def main() -> list[BaseException | None]:
        receiver = Receiver({"r1", "r2", "r3"})
        server, endpoint = await serve(receiver)
        client = TransferClient("p1", timeout_s=2)
        await client.send(endpoint, "r1", {}, b"x", SECRET)
        await server.close()  # the decode worker goes away with the link open on P's side
        sends = (client.send(endpoint, r, {}, b"x" * 1024, SECRET) for r in ("r2", "r3"))
        outcomes = await asyncio.gather(*sends, return_exceptions=True)
        await client.close()
        return list(outcomes)

    outcomes = uvloop.run(main())
    assert [type(o) for o in outcomes] == [Unreachable, Unreachable], outcomes
