"""kill -9 one of two scheduler replicas while requests arrive: none is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import start_system, stop_system


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dispatch", ["scheduler", "api"])
def test_a_dead_scheduler_loses_no_request(tmp_path: Path, dispatch: str) -> None:
    """With either dispatcher (the API places requests itself with ``api``: a scheduler's death
    then takes only what the API could not place)."""
    # its lease (2 s) frees what it held, not claim-idle
    system = start_system(tmp_path, "--schedulers", "2", "--dispatch", dispatch)
    try:

        async def run() -> list[str]:
            client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)

            async def one(i: int) -> str:
                await asyncio.sleep(i * 0.005)
                return (
                    (await client.completions.create(model="tiny", prompt=f"r{i}", max_tokens=4, seed=i))
                    .choices[0]
                    .text
                )

            async def kill() -> None:
                await asyncio.sleep(0.2)
                os.kill(system.pid_of(r"splitbus.cli.main scheduler"), signal.SIGKILL)

            try:
                return list((await asyncio.gather(*(one(i) for i in range(100)), kill()))[:100])
            finally:
                await client.close()

        started = time.monotonic()
        assert asyncio.run(run()) == [sim_text(i, 4) for i in range(100)]
        assert time.monotonic() - started < 30
        assert system.redis().xpending(Keys().requests, "schedulers")["pending"] == 0
    finally:
        stop_system(system)
