"""KV injection and KV theft, tried on real worker processes (sim engine) on loopback: the
attacks of issue 16 now do no harm.

Every test reserves a request on the decode worker D (its decode task only), attacks D's KV
endpoint while D waits for the cache, then lets the real prefill worker P run the request.
The attacker knows the request id (every client does) and D's endpoint (in the registry), not
the reservation's secret, which only readers of Redis see. Where a test plays a buggy or
compromised P (one that holds the secret), it reads the secret from Redis as P does.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from splitbus.bus.control import call
from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.core.keys import WORKER_GROUP
from splitbus.bus.messages import Failed, Finished
from splitbus.redis_server import EmbeddedRedis
from splitbus.worker.engines.sim import sim_text
from splitbus.worker.transfer import (
    ACK,
    HEADER,
    HELLO,
    KV,
    MAGIC,
    MAX_PAYLOAD,
    Refused,
    TransferClient,
    TransferError,
    read_frame,
    write_frame,
)

PROMPT = [72, 105, 33]
KV_BYTES_PER_TOKEN = 4096  # the sim engine's default: the KV P sends is len(PROMPT) * this


@dataclass
class Pair:
    bus: BusConfig
    procs: dict[str, subprocess.Popen[bytes]]


def _worker(role: str, worker_id: str, model: Path, bus: BusConfig) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SPLITBUS_PREFIX": bus.prefix, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "splitbus.cli.main",
        "worker",
        "--role",
        role,
        "--engine",
        "sim",
        "--model",
        str(model),
        "--redis-url",
        bus.redis_url,
        "--worker-id",
        worker_id,
        "--kv-blocks",
        "512",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


@pytest.fixture(scope="module")
def pair(redis_server: EmbeddedRedis, tiny_model: Path) -> Iterator[Pair]:
    import redis

    bus = BusConfig(redis_url=redis_server.url, prefix=f"k{uuid.uuid4().hex[:8]}")
    procs = {"p0": _worker("prefill", "p0", tiny_model, bus), "d0": _worker("decode", "d0", tiny_model, bus)}
    client = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 60
    while not all(client.exists(bus.keys.lease(w)) for w in procs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), "workers did not start"
        time.sleep(0.1)
    yield Pair(bus, procs)
    for proc in procs.values():
        proc.terminate()
    for proc in procs.values():
        assert proc.wait(30) == 0


@pytest.fixture
async def r(pair: Pair) -> AsyncIterator[aioredis.Redis]:
    client = connect(pair.bus)
    yield client
    await client.aclose()


def request(request_id: str, max_tokens: int = 8, seed: int = 5) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "model": "tiny",
        "prompt_token_ids": PROMPT,
        "api_node": "test",
        "sampling": {"max_tokens": max_tokens, "seed": seed, "temperature": 0.0},
        "deadline_ms": 0,
    }


async def add_task(r: aioredis.Redis, bus: BusConfig, worker: str, phase: str, peer: str, req: dict[str, Any]) -> None:
    data = orjson.dumps({"phase": phase, "peer": peer, "request": req}).decode()
    await r.xadd(bus.keys.tasks(worker), {"type": "task", "data": data})


async def reserve(r: aioredis.Redis, bus: BusConfig, request_id: str) -> dict[str, str]:
    """D's reservation for a new request (its decode task only: nothing sends the KV yet)."""
    await add_task(r, bus, "d0", "decode", "p0", request(request_id))
    for _ in range(200):
        found = {k.decode(): v.decode() for k, v in (await r.hgetall(bus.keys.kv(request_id))).items()}
        if found.get("secret"):
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"d0 wrote no reservation for {request_id}")


async def outcome(r: aioredis.Redis, bus: BusConfig, request_id: str) -> tuple[str, Any]:
    """The request's streamed text and its last entry (Finished or Failed)."""
    text, last_id = "", "0"
    for _ in range(60):
        for _, entries in await r.xread({bus.keys.out("test", request_id): last_id}, block=1000) or []:
            for entry_id, fields in entries:
                last_id = entry_id  # the next XREAD goes on after it
                entry = codec.decode(fields)
                text += getattr(entry, "text", "")
                if isinstance(entry, (Finished, Failed)):
                    return text, entry
    raise AssertionError(f"{request_id} did not end")


async def completes_by_the_real_p(r: aioredis.Redis, bus: BusConfig, request_id: str) -> None:
    await add_task(r, bus, "p0", "prefill", "d0", request(request_id))
    text, last = await outcome(r, bus, request_id)
    assert isinstance(last, Finished) and last.finish_reason == "length", last
    assert text == sim_text(5, 8)  # the sim engine's tokens for seed 5: nothing injected


async def payload(bus: BusConfig, r: aioredis.Redis, worker: str = "d0") -> dict[str, Any]:
    reply = await call(r, bus, worker, "get_payload", timeout_s=10)
    assert reply.ok
    return reply.result


async def at_baseline(bus: BusConfig, r: aioredis.Redis) -> None:
    """D holds nothing: every KV block free, no request waiting, every task acked."""
    for _ in range(100):
        d0 = await payload(bus, r)
        pending = (await r.xpending(bus.keys.tasks("d0"), WORKER_GROUP))["pending"]
        if (d0["free_kv_blocks"], d0["waiting_requests"], d0["running_requests"], pending) == (512, 0, 0, 0):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"d0 did not return to baseline: {d0}, {pending} unacked tasks")


async def endpoint_of(r: aioredis.Redis, bus: BusConfig) -> str:
    return (await r.hget(bus.keys.worker("d0"), "transfer_endpoint")).decode()


async def hello(endpoint: str, sender: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    await write_frame(writer, HELLO, sender, {})
    assert (await read_frame(reader)).meta["ok"] is True
    return reader, writer


async def inject(endpoint: str, request_id: str, meta: dict[str, Any], payload: bytes = b"\0" * 64) -> dict[str, Any]:
    """One KV frame as an attacker writes it (claiming to be p0), and D's answer."""
    reader, writer = await hello(endpoint, "p0")
    try:
        await write_frame(writer, KV, request_id, meta, payload)
        ack = await asyncio.wait_for(read_frame(reader), 10)
        assert ack.kind == ACK
        return ack.meta
    finally:
        writer.close()


async def test_frames_without_the_reservations_secret_are_refused_and_the_real_p_completes(
    pair: Pair, r: aioredis.Redis
) -> None:
    bus, rid = pair.bus, f"inj-{uuid.uuid4().hex[:8]}"
    reservation = await reserve(r, bus, rid)
    endpoint = await endpoint_of(r, bus)
    sim_kv = b"\0" * (len(PROMPT) * KV_BYTES_PER_TOKEN)
    good = {"output_token_ids": [97], "next_seq": 1}
    for meta in (
        good,
        {**good, "next_seq": -1},
        {**good, "next_seq": 1000},
        {"next_seq": 1},
        {"output_token_ids": [97] * 100_000, "next_seq": 1},
        {**good, "proof": "0" * 64},
    ):
        ack = await inject(endpoint, rid, meta)
        assert ack["ok"] is False and "not from its prefill worker with the reservation's secret" in ack["error"]
    with pytest.raises(Refused, match="reservation's secret"):  # a guessed secret, by the real client
        await TransferClient("p0", 10).send(endpoint, rid, good, sim_kv, "0" * 64)
    with pytest.raises(Refused, match="reservation's secret"):  # the right secret from the wrong sender
        await TransferClient("p-evil", 10).send(endpoint, rid, good, sim_kv, reservation["secret"])
    assert (await payload(bus, r))["waiting_requests"] == 1  # the reservation still waits for the real P
    assert (await r.hget(bus.keys.kv(rid), "secret")).decode() == reservation["secret"]
    assert not await r.exists(bus.keys.out("test", rid))  # nothing reached the client's stream
    await completes_by_the_real_p(r, bus, rid)
    await at_baseline(bus, r)


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        ({"output_token_ids": [97], "next_seq": -1}, "next_seq must be 1"),
        ({"output_token_ids": [97], "next_seq": 1000}, "next_seq must be 1"),
        ({"output_token_ids": [97], "next_seq": "1"}, "next_seq must be 1"),
        ({"next_seq": 1}, "output_token_ids must be a non-empty list"),
        ({"output_token_ids": [], "next_seq": 1}, "output_token_ids must be a non-empty list"),
        ({"output_token_ids": [97] * 100_000, "next_seq": 100_000}, "holds 100000 tokens; expected 1 to 7"),
        ({"output_token_ids": [4294967296], "next_seq": 1}, "output_token_ids must hold integers in [0,"),
        ({"output_token_ids": [-1], "next_seq": 1}, "output_token_ids must hold integers in [0,"),
    ],
)
async def test_a_proven_frame_with_bad_meta_fails_the_request_frees_its_blocks_and_d_serves_on(
    pair: Pair, r: aioredis.Redis, meta: dict[str, Any], problem: str
) -> None:
    # A buggy or compromised P: it holds the secret, and sends what P never would.
    bus, rid = pair.bus, f"bad-{uuid.uuid4().hex[:8]}"
    reservation = await reserve(r, bus, rid)
    client = TransferClient("p0", 10)
    with pytest.raises(Refused, match=problem.replace("[", r"\[")):
        await client.send(await endpoint_of(r, bus), rid, meta, b"\0" * 64, reservation["secret"])
    await client.close()
    _, last = await outcome(r, bus, rid)
    assert isinstance(last, Failed) and last.code == "kv_rejected" and problem in last.message
    await at_baseline(bus, r)
    assert pair.procs["d0"].poll() is None
    rid2 = f"after-{uuid.uuid4().hex[:8]}"
    await reserve(r, bus, rid2)
    await completes_by_the_real_p(r, bus, rid2)


def peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM): what buffering a payload would have raised."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def declare(endpoint: str, request_id: str, size: int) -> tuple[dict[str, Any], bytes]:
    """A KV header declaring ``size`` payload bytes, none of which follow; D's ack, then what
    D sends until it closes (b"" once closed)."""
    reader, writer = await hello(endpoint, "p0")
    info = orjson.dumps({"output_token_ids": [97], "next_seq": 1})
    writer.write(HEADER.pack(MAGIC, KV, len(request_id), len(info), size, 0) + request_id.encode() + info)
    await writer.drain()
    try:
        ack = await asyncio.wait_for(read_frame(reader), 10)
        return ack.meta, await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def stream(endpoint: str, request_id: str, size: int) -> int:
    """Declare ``size`` bytes and send them, 1 MiB at a time from one buffer; returns how many
    bytes went out before D closed the connection."""
    reader, writer = await hello(endpoint, "p0")
    info = orjson.dumps({"output_token_ids": [97], "next_seq": 1})
    writer.write(HEADER.pack(MAGIC, KV, len(request_id), len(info), size, 0) + request_id.encode() + info)
    chunk, sent = bytes(1 << 20), 0
    try:
        while sent < size:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 10)
            sent += len(chunk)
    except (ConnectionError, TransferError):
        pass
    finally:
        writer.close()
    return sent


async def test_a_frame_declaring_more_than_the_reservation_is_refused_unread(pair: Pair, r: aioredis.Redis) -> None:
    bus, rid = pair.bus, f"big-{uuid.uuid4().hex[:8]}"
    reservation = await reserve(r, bus, rid)
    endpoint, pid = await endpoint_of(r, bus), pair.procs["d0"].pid
    before = peak_rss(pid)
    for size in (MAX_PAYLOAD, 300 << 20):  # 64 GiB (the protocol's limit), and 300 MiB
        ack, rest = await declare(endpoint, rid, size)
        assert ack["ok"] is False and rest == b""  # refused from the header, then closed
    sent = await stream(endpoint, rid, 300 << 20)
    assert sent < 300 << 20  # D closed the connection instead of reading the 300 MiB
    assert peak_rss(pid) - before < 64 << 20  # before the fix: +600 MiB (the payload, then a copy)
    assert (await r.hget(bus.keys.kv(rid), "secret")).decode() == reservation["secret"]
    assert (await payload(bus, r))["waiting_requests"] == 1
    await completes_by_the_real_p(r, bus, rid)
    await at_baseline(bus, r)


async def test_a_proven_frame_larger_than_the_reserved_blocks_fails_the_request(pair: Pair, r: aioredis.Redis) -> None:
    bus, rid = pair.bus, f"over-{uuid.uuid4().hex[:8]}"
    reservation = await reserve(r, bus, rid)
    blocks = int(reservation["blocks"])
    client = TransferClient("p0", 10)
    with pytest.raises(TransferError):  # Refused, or the reset of the connection D closed
        await client.send(
            await endpoint_of(r, bus),
            rid,
            {"output_token_ids": [97], "next_seq": 1},
            bytes(blocks * 16 * KV_BYTES_PER_TOKEN + 1),
            reservation["secret"],
        )
    await client.close()
    _, last = await outcome(r, bus, rid)
    assert isinstance(last, Failed) and last.code == "kv_rejected" and "more than the" in last.message
    await at_baseline(bus, r)
