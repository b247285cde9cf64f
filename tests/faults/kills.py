"""Streams through the API while a part is killed: what the worker- and group-death tests share."""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import time
from collections.abc import Callable, Mapping

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
    logprobs: int | None = None,
    extra_body: Mapping[str, object] | None = None,
    act: Callable[[], object] | None = None,
    letter: int = 97,
) -> list[str]:
    """Stream ``count`` completions (request i with seed ``first_seed + i``; ``extra_body``: more
    fields for each) and kill -9 the part whose command line matches ``victim`` ``after_s`` in; the
    texts, in request order. With ``logprobs``, each stream asks for them, and its tokens' logprobs
    must be the sim model's (``sim_logprobs``): one per token of the text, none lost or repeated
    where the request moved. ``act``: what happens ``after_s`` in instead of the kill (a signal to
    a part ``up`` does not run: ``victim`` is then unused); ``letter``: the token the prompts are
    made of (``_prompt``), another for prompts no worker has cached from an earlier test."""
    client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=timeout_s)

    async def one(i: int) -> str:
        stream = await client.completions.create(
            model="tiny",
            prompt=_prompt(i, prompt_tokens, letter),
            max_tokens=max_tokens,
            seed=first_seed + i,
            stream=True,
            logprobs=logprobs,
            extra_body=extra_body,
        )
        chunks = [c.choices[0] async for c in stream if c.choices]
        text = "".join(c.text for c in chunks)
        if logprobs is not None:
            shown = [c.logprobs for c in chunks if c.logprobs is not None]
            assert "".join(t for lp in shown for t in lp.tokens or []) == text
            assert {v for lp in shown for v in lp.token_logprobs or []} == {math.log(0.5)}
            assert all(len(top) == logprobs for lp in shown for top in lp.top_logprobs or [])
        return text

    async def killer() -> None:
        await asyncio.sleep(after_s)
        if act is not None:
            act()
        else:
            os.kill(system.pid_of(victim), signal.SIGKILL)

    try:
        kill = asyncio.ensure_future(killer())  # beside the streams, not in their gather
        texts = await asyncio.gather(*(one(i) for i in range(count)))
        await kill
        return list(texts)
    finally:
        await client.close()


def _prompt(i: int, tokens: int, letter: int = 97) -> list[int]:
    """Request ``i``'s prompt: its own first token, so that no two share a block and cache-aware
    routing spreads them by load as the kills expect (the same prompt would all go where it is
    cached)."""
    return [letter + i % 26] + [letter] * (tokens - 1)


def moved_tasks(system: System, since: int) -> int:
    """Tasks the reaper moved, from the scheduler's log (it logs each dead worker it takes),
    from line ``since`` of ``up``'s output on; 0 when none is logged within 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = re.findall(r"is dead: moved (\d+) task", "".join(system.output[since:]))
        if found:
            return sum(map(int, found))
        time.sleep(0.2)
    return 0
