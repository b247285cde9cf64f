"""A request that breaks the engine ends with an error and a dead letter; the worker keeps
serving the requests batched with it and those after it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import orjson
import pytest

from splitbus.worker.sim import sim_text
from tests.e2e.conftest import start_system, stop_system

POISON = 7  # a token id the sim engine is told to choke on


@pytest.mark.timeout(120)
def test_poison_request_is_isolated(tmp_path: Path) -> None:
    system = start_system(tmp_path, "--mixed", "1", f"--worker-arg=--sim-poison-token={POISON}", "--worker-arg=--sim-decode-step-ms", "--worker-arg=10")
    try:
        async def run() -> list[object]:
            client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)

            async def good(i: int) -> str:
                return (await client.completions.create(model="tiny", prompt=[60, 61, 62], max_tokens=30, seed=i)).choices[0].text

            async def bad() -> object:
                try:
                    await client.completions.create(model="tiny", prompt=[60, POISON, 62], max_tokens=30)
                    return "served"
                except openai.APIStatusError as exc:
                    return exc

            try:
                return list(await asyncio.gather(*(good(i) for i in range(6)), bad()))
            finally:
                await client.close()

        *texts, failure = asyncio.run(run())
        assert texts == [sim_text(i, 30) for i in range(6)]  # batched with the poison, unharmed
        assert isinstance(failure, openai.APIStatusError) and failure.status_code == 500
        assert "the engine failed on this request" in str(failure.body)
        letters = [orjson.loads(f["data"]) for _, f in system.redis().xrange("sb:dead")]
        assert [d["reason"].split(":")[0] for d in letters] == ["engine_error"]
        after = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0).completions.create(model="tiny", prompt="x", max_tokens=3, seed=1)
        assert after.choices[0].text == sim_text(1, 3)  # the worker is still serving
    finally:
        assert stop_system(system) == []
