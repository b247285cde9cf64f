"""Redis restarts under a running system: in-flight requests complete or end with a clear
error before their deadline (none hangs), and every part reconnects and serves new requests."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import pytest

from splitbus.redis_server import EmbeddedRedis
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import start_system, stop_system

DEADLINE_S = 15


@pytest.mark.timeout(180)
def test_redis_restart_mid_run(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")  # AOF on, as the embedded Redis of `splitbus up`
    server.start()
    system = start_system(
        tmp_path / "up",
        "--redis-url",
        server.url,
        "--request-timeout",
        str(DEADLINE_S),
        "--worker-arg=--sim-decode-step-ms",
        "--worker-arg=20",
    )
    try:
        outcomes = asyncio.run(asyncio.wait_for(_run_through_restart(system.v1, server), DEADLINE_S + 30))
        for i, outcome in enumerate(outcomes):
            assert outcome == sim_text(700 + i, 100) or outcome.startswith("error "), outcome  # exact, or a clear error
        assert _serves_again(system.v1)
    finally:
        stop_system(system)
        server.stop()


async def _run_through_restart(base_url: str, server: EmbeddedRedis) -> list[str]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=DEADLINE_S + 10)

    async def one(i: int) -> str:
        try:
            stream = await client.completions.create(
                model="tiny", prompt="go", max_tokens=100, seed=700 + i, stream=True
            )
            return "".join([c.choices[0].text async for c in stream])
        except openai.APIError as exc:
            return f"error {exc}"

    async def restart() -> None:
        await asyncio.sleep(0.7)  # mid-stream: 100 tokens take ~2 s
        # Blocking calls on purpose: the server must be started by a thread that lives on
        # (PR_SET_PDEATHSIG ends the child when the thread that started it exits).
        server.stop()
        await asyncio.sleep(0.5)
        server.start()  # same port, same AOF

    try:
        results = await asyncio.gather(*(one(i) for i in range(10)), restart())
        return list(results[:10])
    finally:
        await client.close()


def _serves_again(base_url: str) -> bool:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            return client.completions.create(model="tiny", prompt="after", max_tokens=5, seed=9).choices[
                0
            ].text == sim_text(9, 5)
        except openai.APIError:
            time.sleep(0.5)
    return False
