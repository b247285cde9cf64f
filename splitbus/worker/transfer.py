"""KV-cache transfer from a prefill worker to a decode worker over TCP (asyncio streams).

Every frame is a fixed header, then the request id, a small JSON object and the payload::

    magic "SBKV" | kind u8 | id length u16 | meta length u32 | payload length u64 | crc32 u32

Kinds: HELLO (P introduces itself with its worker id as the frame's id; D acks), KV (one
request's cache; D acks after checking its CRC and importing it), ACK (``{"ok": bool, "error":
str}``, no payload). The payload goes to the socket as a memoryview, without another copy. Both
sides set TCP_NODELAY: acks are small frames.

Who may send a request's KV: D writes a random secret into its reservation ``sb:kv:{cell}:<request>``
(only readers of Redis learn it); P puts ``proof`` in the KV frame's meta, an HMAC-SHA256 keyed
by that secret over the sender's id, the request id, the rest of the meta, the payload length
and the payload's CRC (``splitbus.worker.kv_proof``). Every one of those is in the header and
meta, so D checks the sender, the proof, the size and the meta before it reads (or allocates) a
byte of the payload. A frame D refuses before its payload ends the connection (its payload is
never read), unless the payload is small enough to skip. A connection that sends no HELLO within ``HELLO_TIMEOUT_S``, or
that arrives while ``MAX_CONNECTIONS`` are open, is closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from splitbus.worker.kv_proof import Header, kv_proof

log = logging.getLogger(__name__)

MAGIC = b"SBKV"
HEADER = struct.Struct("!4sBHIQI")
HELLO, KV, ACK = 1, 2, 3
MAX_META = 1 << 20
MAX_PAYLOAD = 1 << 36
MAX_SKIP = 1 << 20
"""A refused frame's payload up to this size is read and dropped (the connection stays);
a larger one is never read: the connection closes instead."""


class TransferError(Exception):
    """A transfer failed: no connection, a bad frame, a refusal, or a timeout."""


class Refused(TransferError):
    """The receiver answered, and refused this request's KV."""


class Unreachable(TransferError):
    """The receiver did not answer: the connection was refused, reset or closed, or timed out.
    Unlike a refusal, this says the peer may be dead (or hung), not that the request is bad."""


@dataclass(frozen=True)
class Frame:
    kind: int
    ident: str
    meta: dict[str, Any]
    payload: bytes


async def write_frame(
    writer: asyncio.StreamWriter,
    kind: int,
    ident: str,
    meta: dict[str, Any],
    payload: bytes | memoryview = b"",
    crc: int | None = None,
) -> None:
    """``crc``: the payload's CRC when the caller has it already (the proof needs it first)."""
    name, info = ident.encode(), orjson.dumps(meta)
    view = memoryview(payload)
    writer.write(HEADER.pack(MAGIC, kind, len(name), len(info), view.nbytes, zlib.crc32(view) if crc is None else crc))
    writer.write(name + info)
    if view.nbytes:
        writer.write(view)
    await writer.drain()


async def read_header(reader: asyncio.StreamReader, max_payload: int = MAX_PAYLOAD) -> Header:
    """The next frame up to its payload; TransferError for anything that is not one."""
    try:
        magic, kind, name_len, meta_len, size, crc = HEADER.unpack(await reader.readexactly(HEADER.size))
        if magic != MAGIC or kind not in (HELLO, KV, ACK) or meta_len > MAX_META or size > max_payload:
            raise TransferError(f"not a splitbus KV frame (or a payload over {max_payload} bytes)")
        name = (await reader.readexactly(name_len)).decode()
        meta = orjson.loads(await reader.readexactly(meta_len))
    except asyncio.IncompleteReadError as exc:
        raise Unreachable("connection closed") from exc
    except (UnicodeDecodeError, orjson.JSONDecodeError) as exc:
        raise TransferError(f"unreadable frame id or meta: {exc}") from None
    if not isinstance(meta, dict):
        raise TransferError("a frame's meta must be a JSON object")
    return Header(kind, name, meta, size, crc)


async def read_payload(reader: asyncio.StreamReader, header: Header) -> bytes:
    try:
        payload = await reader.readexactly(header.size)
    except asyncio.IncompleteReadError as exc:
        raise Unreachable("connection closed") from exc
    if zlib.crc32(payload) != header.crc:
        raise TransferError(f"checksum mismatch for {header.ident}")
    return payload


async def read_frame(reader: asyncio.StreamReader, max_payload: int = MAX_PAYLOAD) -> Frame:
    header = await read_header(reader, max_payload)
    return Frame(header.kind, header.ident, header.meta, await read_payload(reader, header))


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


KvCheck = Callable[[str, Header], "str | None"]
"""Called with (the sender's HELLO id, the frame's header) before the payload is read; returns
why the KV is refused, or None."""
KvHandler = Callable[[str, Header, bytes], Awaitable["str | None"]]
"""Called with (sender, header, payload) once the payload is in; returns why it is refused, or None."""


HELLO_TIMEOUT_S = 10.0
"""A connection to the KV port must name its sender (HELLO) within this."""
MAX_CONNECTIONS = 512
"""Connections the KV port keeps open at once: far above the prefill workers of a deployment."""
CLOSE_TIMEOUT_S = 5.0
"""How long a stopping KV server waits for a connection's KV import under way to finish."""


class TransferServer:
    """The decode side: accepts connections from prefill workers and imports their KV."""

    def __init__(
        self,
        worker_id: str,
        check: KvCheck,
        on_kv: KvHandler,
        *,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.worker_id = worker_id
        self._check = check
        self._on_kv = on_kv
        self._server: asyncio.Server | None = None
        # Anyone who reaches the port can connect: a connection that names no sender in time, or
        # one past the cap, is closed, so strangers cannot hold the worker's sockets open.
        self._hello_timeout_s = hello_timeout_s
        self._max_connections = max_connections
        self.open_connections = 0
        self._handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._closing = False

    async def start(self, host: str, port: int, advertise_host: str = "") -> str:
        """Listen; returns the endpoint to publish (``advertise_host``, default ``host``, and the
        bound port)."""
        self._server = await asyncio.start_server(self._serve, host, port)
        bound = self._server.sockets[0].getsockname()
        return f"{advertise_host or host}:{bound[1]}"

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop listening, end the open connections and wait for their handlers. A prefill
        worker keeps its connection open, so its handler would still be waiting for the next
        frame when the event loop ends and cancels it, and Python 3.11's asyncio logs a cancelled
        handler as a CancelledError traceback (its callback calls ``exception()`` on the task).
        The connections are closed before ``wait_closed``, which on Python 3.12 waits for them."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for writer in self._handlers.values():
            writer.close()  # the handler's next read finds the connection closed and returns
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=timeout_s)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:
            writer.close()
            return
        if self.open_connections >= self._max_connections:
            log.warning("KV port: %d connections open, closing a new one", self.open_connections)
            writer.close()
            return
        self.open_connections += 1
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers[handler] = writer
        _nodelay(writer)
        try:
            sender = await asyncio.wait_for(self._hello(reader, writer), self._hello_timeout_s)
            while await self._one_frame(sender, reader, writer):
                pass
        except (TransferError, ConnectionError, asyncio.TimeoutError) as exc:
            log.debug("transfer connection ended: %s", exc or type(exc).__name__)
        except asyncio.CancelledError:
            pass  # cancelled anyway (close() timed out): still no traceback, as said in close()
        finally:
            self.open_connections -= 1
            del self._handlers[handler]
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """A connection starts with the sender's HELLO; its id is the sender of every frame after."""
        hello = await read_header(reader, max_payload=0)
        if hello.kind != HELLO or not hello.ident:
            raise TransferError("a connection must start with a HELLO naming the sender")
        await self._ack(writer, hello.ident, None)
        return hello.ident

    async def _one_frame(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one KV frame; False when the connection must end."""
        header = await read_header(reader)
        refusal = f"unexpected frame kind {header.kind}" if header.kind != KV else self._check(sender, header)
        if refusal is not None:
            await self._ack(writer, header.ident, refusal)
            return await self._skip(reader, header)
        error = await self._on_kv(sender, header, await read_payload(reader, header))
        await self._ack(writer, header.ident, error)
        return True

    @staticmethod
    async def _skip(reader: asyncio.StreamReader, header: Header) -> bool:
        """Drop a refused frame's payload if it is small; a large one is never read (False)."""
        if header.size > MAX_SKIP:
            return False
        await read_payload(reader, header)
        return True

    async def _ack(self, writer: asyncio.StreamWriter, ident: str, error: str | None) -> None:
        await write_frame(writer, ACK, ident, {"ok": error is None, "error": error or "", "worker": self.worker_id})


class _Link:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.lock = asyncio.Lock()  # one frame and its ack at a time per connection


class TransferClient:
    """The prefill side: one connection per decode endpoint, opened with a HELLO."""

    def __init__(self, worker_id: str, timeout_s: float) -> None:
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self._links: dict[str, _Link] = {}

    def connected(self, endpoint: str) -> bool:
        link = self._links.get(endpoint)
        return link is not None and not link.writer.is_closing()

    async def connect(self, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.timeout_s)
        except (OSError, asyncio.TimeoutError, ValueError) as exc:
            raise Unreachable(f"cannot connect to {endpoint}: {exc or type(exc).__name__}") from None
        _nodelay(writer)
        link = _Link(reader, writer)
        await self._exchange(link, endpoint, HELLO, self.worker_id, {})
        self._links[endpoint] = link

    async def send(
        self, endpoint: str, request_id: str, meta: dict[str, Any], payload: bytes | memoryview, secret: str
    ) -> None:
        """Send one request's KV with the proof for ``secret``, the one in D's reservation."""
        if not self.connected(endpoint):
            await self.connect(endpoint)
        view = memoryview(payload)
        crc = zlib.crc32(view)
        signed = {**meta, "proof": kv_proof(secret, self.worker_id, request_id, meta, view.nbytes, crc)}
        await self._exchange(self._links[endpoint], endpoint, KV, request_id, signed, view, crc)

    async def _exchange(
        self,
        link: _Link,
        endpoint: str,
        kind: int,
        ident: str,
        meta: dict[str, Any],
        payload: bytes | memoryview = b"",
        crc: int | None = None,
    ) -> None:
        async with link.lock:
            try:
                await asyncio.wait_for(self._round_trip(link, kind, ident, meta, payload, crc), self.timeout_s)
            except Refused:
                if memoryview(payload).nbytes > MAX_SKIP:  # the receiver closes after refusing a large frame
                    self._drop(endpoint, link)
                raise
            except (OSError, asyncio.TimeoutError, Unreachable) as exc:  # reset, closed, no answer
                self._drop(endpoint, link)
                raise Unreachable(f"transfer to {endpoint} failed: {exc or type(exc).__name__}") from None
            except TransferError as exc:  # an answer that is not a frame
                self._drop(endpoint, link)
                raise TransferError(f"transfer to {endpoint} failed: {exc}") from None
            except BaseException:  # cancelled mid-frame (its peer was found dead): the stream is unusable
                self._drop(endpoint, link)
                raise

    async def _round_trip(
        self, link: _Link, kind: int, ident: str, meta: dict[str, Any], payload: bytes | memoryview, crc: int | None
    ) -> None:
        # Two hand-offs to one endpoint take the same link and queue on its lock; when the first
        # fails, it drops (closes) the link, and the second then wrote on a closed transport, which
        # uvloop refuses with a RuntimeError that no handler took for a connection failure (the
        # request failed instead of being retried on a new connection). Nothing can close the link
        # between this check and the writes: they run without yielding.
        if link.writer.is_closing():
            raise ConnectionResetError("the connection was closed (dropped after another transfer on it failed)")
        await write_frame(link.writer, kind, ident, meta, payload, crc)
        ack = await read_frame(link.reader, max_payload=0)  # an ack has no payload: never read one
        if ack.kind != ACK or ack.meta.get("ok") is not True:
            raise Refused(f"{ident} refused: {ack.meta.get('error') or 'no reason'}")

    def _drop(self, endpoint: str, link: _Link) -> None:
        link.writer.close()
        if self._links.get(endpoint) is link:
            del self._links[endpoint]

    async def close(self) -> None:
        for endpoint, link in list(self._links.items()):
            self._drop(endpoint, link)
