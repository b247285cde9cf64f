"""KV-cache transfer from a prefill worker to a decode worker over TCP (asyncio streams).

Every frame is a fixed header, then the request id, a small JSON object and the payload::

    magic "SBKV" | kind u8 | id length u16 | meta length u32 | payload length u64 | crc32 u32

Kinds: HELLO (P introduces itself; D acks), KV (one request's cache; D acks after checking its
CRC and importing it), ACK (``{"ok": bool, "error": str}``). The payload goes to the socket as
a memoryview, without another copy. Both sides set TCP_NODELAY: acks are small frames.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import orjson

log = logging.getLogger(__name__)

MAGIC = b"SBKV"
HEADER = struct.Struct("!4sBHIQI")
HELLO, KV, ACK = 1, 2, 3
MAX_META = 1 << 20
MAX_PAYLOAD = 1 << 36


class TransferError(Exception):
    """A transfer failed: no connection, a bad frame, a refusal, or a timeout."""


class Refused(TransferError):
    """The receiver answered, and refused this request's KV; the connection stays usable."""


@dataclass(frozen=True)
class Frame:
    kind: int
    ident: str
    meta: dict[str, Any]
    payload: bytes


async def write_frame(writer: asyncio.StreamWriter, kind: int, ident: str, meta: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    name, info = ident.encode(), orjson.dumps(meta)
    view = memoryview(payload)
    writer.write(HEADER.pack(MAGIC, kind, len(name), len(info), view.nbytes, zlib.crc32(view)))
    writer.write(name + info)
    if view.nbytes:
        writer.write(view)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    try:
        magic, kind, name_len, meta_len, size, crc = HEADER.unpack(await reader.readexactly(HEADER.size))
    except asyncio.IncompleteReadError as exc:
        raise TransferError("connection closed") from exc
    if magic != MAGIC or meta_len > MAX_META or size > MAX_PAYLOAD:
        raise TransferError("not a splitbus KV frame")
    name = (await reader.readexactly(name_len)).decode()
    meta = orjson.loads(await reader.readexactly(meta_len))
    payload = await reader.readexactly(size)
    if zlib.crc32(payload) != crc:
        raise TransferError(f"checksum mismatch for {name}")
    return Frame(kind, name, meta, payload)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


KvHandler = Callable[[str, dict[str, Any], bytes], Awaitable["str | None"]]
"""Called with (request id, meta, payload); returns why the KV is refused, or None."""


class TransferServer:
    """The decode side: accepts connections from prefill workers and imports their KV."""

    def __init__(self, worker_id: str, on_kv: KvHandler) -> None:
        self.worker_id = worker_id
        self._on_kv = on_kv
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, advertise_host: str = "") -> str:
        """Listen; returns the endpoint to publish (``advertise_host``, default ``host``, and the
        bound port)."""
        self._server = await asyncio.start_server(self._serve, host, port)
        bound = self._server.sockets[0].getsockname()
        return f"{advertise_host or host}:{bound[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        try:
            while True:
                frame = await read_frame(reader)
                error = await self._handle(frame)
                await write_frame(writer, ACK, frame.ident, {"ok": error is None, "error": error or "", "worker": self.worker_id})
        except (TransferError, ConnectionError, asyncio.IncompleteReadError) as exc:
            log.debug("transfer connection ended: %s", exc)
        finally:
            writer.close()

    async def _handle(self, frame: Frame) -> str | None:
        if frame.kind == HELLO:
            return None
        if frame.kind == KV:
            return await self._on_kv(frame.ident, frame.meta, frame.payload)
        return f"unexpected frame kind {frame.kind}"


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
            raise TransferError(f"cannot connect to {endpoint}: {exc or type(exc).__name__}") from None
        _nodelay(writer)
        link = _Link(reader, writer)
        await self._exchange(link, endpoint, HELLO, self.worker_id, {})
        self._links[endpoint] = link

    async def send(self, endpoint: str, request_id: str, meta: dict[str, Any], payload: bytes) -> None:
        if not self.connected(endpoint):
            await self.connect(endpoint)
        await self._exchange(self._links[endpoint], endpoint, KV, request_id, meta, payload)

    async def _exchange(self, link: _Link, endpoint: str, kind: int, ident: str, meta: dict[str, Any], payload: bytes = b"") -> None:
        async with link.lock:
            try:
                await asyncio.wait_for(self._round_trip(link, kind, ident, meta, payload), self.timeout_s)
            except Refused:
                raise
            except (OSError, asyncio.TimeoutError, TransferError) as exc:
                self._drop(endpoint, link)
                raise TransferError(f"transfer to {endpoint} failed: {exc or type(exc).__name__}") from None

    async def _round_trip(self, link: _Link, kind: int, ident: str, meta: dict[str, Any], payload: bytes) -> None:
        await write_frame(link.writer, kind, ident, meta, payload)
        ack = await read_frame(link.reader)
        if ack.kind != ACK or not ack.meta.get("ok"):
            raise Refused(f"{ident} refused: {ack.meta.get('error') or 'no reason'}")

    def _drop(self, endpoint: str, link: _Link) -> None:
        link.writer.close()
        if self._links.get(endpoint) is link:
            del self._links[endpoint]

    async def close(self) -> None:
        for endpoint, link in list(self._links.items()):
            self._drop(endpoint, link)
