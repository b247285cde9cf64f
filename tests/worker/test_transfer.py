"""The KV transfer protocol over real loopback sockets."""

from __future__ import annotations

import asyncio
import struct

import pytest

from splitbus.worker.transfer import HEADER, MAGIC, Refused, TransferClient, TransferError, TransferServer


async def test_kv_arrives_intact_and_refusals_keep_the_connection() -> None:
    received: dict[str, tuple[dict, bytes]] = {}

    async def on_kv(rid: str, meta: dict, payload: bytes) -> str | None:
        if rid == "unknown":
            return "no reservation"
        received[rid] = (meta, payload)
        return None

    server = TransferServer("d1", on_kv)
    endpoint = await server.start("127.0.0.1", 0)
    client = TransferClient("p1", timeout_s=5)
    payload = bytes(range(256)) * 4096  # 1 MiB
    await client.send(endpoint, "r1", {"next_seq": 1}, memoryview(payload))
    assert received["r1"] == ({"next_seq": 1}, payload)
    with pytest.raises(Refused, match="no reservation"):
        await client.send(endpoint, "unknown", {}, b"x")
    assert client.connected(endpoint)
    await client.send(endpoint, "r2", {}, b"")
    assert "r2" in received
    await client.close()
    await server.close()


async def test_unreachable_endpoint_is_a_transfer_error() -> None:
    from splitbus.redis_server import free_port

    with pytest.raises(TransferError, match="cannot connect"):
        await TransferClient("p1", timeout_s=2).connect(f"127.0.0.1:{free_port()}")


async def test_corrupt_frame_is_rejected() -> None:
    async def accept_all(*_: object) -> None:
        return None

    server = TransferServer("d1", accept_all)
    host, port = (await server.start("127.0.0.1", 0)).split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(HEADER.pack(MAGIC, 2, 1, 2, 3, 12345) + b"r{}" + b"abc")  # wrong CRC
    await writer.drain()
    assert await reader.read() == b""  # the server drops a connection that sends garbage
    writer.close()
    await server.close()
    assert struct.calcsize("!4sBHIQI") == HEADER.size
