"""Streams through the API while a part is killed: what the worker- and group-death tests share."""

from __future__ import annotations

import asyncio
import os
import signal

import openai

from tests.e2e.conftest import System


async def streams_with_a_kill(
    system: System,
    count: int,
    max_tokens: int,
    prompt_tokens: int,
    victim: str,
    *,
    after_s: float,
    first_seed: int,
    timeout_s: float = 120,
) -> list[str]:
    """Stream ``count`` completions (request i with seed ``first_seed + i``) and kill -9 the part whose
    command line matches ``victim`` ``after_s`` in; the texts, in request order."""
    client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=timeout_s)

    async def one(i: int) -> str:
        stream = await client.completions.create(
            model="tiny", prompt=_prompt(i, prompt_tokens), max_tokens=max_tokens, seed=first_seed + i, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def killer() -> None:
        await asyncio.sleep(after_s)
        os.kill(system.pid_of(victim), signal.SIGKILL)

    try:
        kill = asyncio.ensure_future(killer())  # beside the streams, not in their gather
        texts = await asyncio.gather(*(one(i) for i in range(count)))
        await kill
        return list(texts)
    finally:
        await client.close()


def _prompt(i: int, tokens: int) -> list[int]:
    """Request ``i``'s prompt: its own first token, so that no two share a block and cache-aware
    routing spreads them by load as the kills expect (the same prompt would all go where it is
    cached)."""
    return [97 + i % 26] + [97] * (tokens - 1)
