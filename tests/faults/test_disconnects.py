"""Clients that disconnect mid-stream: their requests are cancelled on every worker and the KV
blocks come back (read from the registry, as an operator would); the first test on a single Redis
and on a cluster."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from splitbus.bus.core.keys import Keys
from tests.e2e.conftest import System, start_system, stop_system


async def _connect_then_leave(system: System, count: int) -> list[tuple[str, int, int, int]]:
    """Open ``count`` streams, wait until each has its first chunk, sample the workers' KV
    blocks, then drop every connection mid-stream. Returns the sample."""
    body = {"model": "tiny", "prompt": "stay a while", "max_tokens": 400, "stream": True}
    streaming, leave = asyncio.Semaphore(0), asyncio.Event()
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=count + 5)) as client:

        async def one() -> None:
            async with client.stream("POST", system.v1 + "/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        streaming.release()
                        await leave.wait()
                        return  # closing the response drops the connection mid-stream

        tasks = [asyncio.create_task(one()) for _ in range(count)]
        for _ in range(count):
            await asyncio.wait_for(streaming.acquire(), 30)
        await asyncio.sleep(0.6)  # a heartbeat publishes the held blocks
        sample = _blocks(system)
        leave.set()
        await asyncio.gather(*tasks)
    return sample


def _blocks(system: System) -> list[tuple[str, int, int, int]]:
    r = system.redis()
    rows = []
    for wid in r.zrange(Keys().workers, 0, -1):
        h = r.hgetall(Keys().worker(wid))
        rows.append(
            (h["role"], int(h["free_kv_blocks"]), int(h["total_kv_blocks"]), int(h["running"]) + int(h["waiting"]))
        )
    return rows


def _assert_blocks_return(system: System, within_s: float) -> None:
    """Every worker's free KV blocks are back to its total and it holds no request."""
    deadline = time.monotonic() + within_s
    while any(free != total or held for _, free, total, held in _blocks(system)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(free == total and held == 0 for _, free, total, held in _blocks(system)), _blocks(system)


@pytest.mark.timeout(120)
def test_fifty_disconnects_free_every_kv_block(tmp_path: Path, bus_environ: dict[str, str]) -> None:
    system = start_system(tmp_path, "--worker-arg=--sim-decode-step-ms", "--worker-arg=20", environ=bus_environ)
    try:
        during = asyncio.run(_connect_then_leave(system, 50))
        assert any(free < total for role, free, total, _ in during if role == "decode"), during  # they held blocks
        _assert_blocks_return(system, within_s=10)
        assert len(system.redis().xrange(Keys().cancel)) >= 50
    finally:
        stop_system(system)


@pytest.mark.timeout(120)
def test_a_request_past_its_deadline_ends_with_an_error_and_frees_its_blocks(tmp_path: Path) -> None:
    system = start_system(tmp_path, "--request-timeout", "2", "--worker-arg=--sim-decode-step-ms", "--worker-arg=20")
    try:
        started = time.monotonic()
        response = httpx.post(
            system.v1 + "/completions", json={"model": "tiny", "prompt": "slow", "max_tokens": 400}, timeout=30
        )
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "deadline"  # the worker's own error, before the API's grace ran out
        assert time.monotonic() - started < 4
        _assert_blocks_return(system, within_s=5)
    finally:
        stop_system(system)
