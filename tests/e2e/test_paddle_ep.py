"""Expert parallelism end to end: `splitbus up --engine paddle --ep` with a prefill group and a
decode group, each of 2 or 4 ranks holding a share of a tiny MoE model's experts (gloo on
loopback, formed through `sb:ep:{group}`). Greedy text through P group -> KV over TCP -> D group
equals the engine's full recompute on one model holding every expert (itself checked against a
numpy reference in tests/worker/engines/paddle/test_moe.py). Kept small: two layers, hidden 64."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from splitbus.gpu_ops import device

device.prepare()

from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from tests.e2e import greedy  # noqa: E402
from tests.e2e.conftest import start_system, stop_system  # noqa: E402

NEW = 8
PROMPTS = greedy.prompts(13, (1, 9, 17, 40, 5, 23))
SHARED = greedy.prompts(14, (48,))[0]
"""A prefix of three KV blocks that the prefix-cache round's prompts share."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("arch", "ranks"), [("mixtral", 2), ("qwen3_moe", 2), ("mixtral", 4)])
def test_greedy_text_through_expert_parallel_p_and_d_groups_matches_one_model(
    tmp_path: Path, arch: str, ranks: int
) -> None:
    model_dir = make_tiny_model(tmp_path / "tiny", arch, seed=5, hidden=64, layers=2)
    reference = greedy.reference(model_dir, PROMPTS, NEW)
    assert all(reference)
    groups = ("--prefill-dp", str(ranks), "--decode-dp", str(ranks), "--ep")
    system = start_system(tmp_path / "up", "--engine", "paddle", "--model", str(model_dir), *groups)
    try:
        assert asyncio.run(greedy.ask_all(system.v1, PROMPTS, NEW)) == reference
        for group in ("p0", "d0"):
            system.wait_output(rf"^{group}-r0 .*DP group {group}: expert-parallel group formed", 5)
        last = ranks - 1
        system.wait_output(rf"^p0-r{last} .*rank {last} of {ranks} holds experts {last * 4 // ranks}-", 5)
        if ranks == 2:
            asyncio.run(_prefix_cache_and_cancellation(system.v1, model_dir))
    finally:
        assert stop_system(system) == []


async def _prefix_cache_and_cancellation(v1: str, model_dir: Path) -> None:
    """MoE requests under EP as dense ones: prompts sharing a cached prefix give the recompute's
    text (the cache's blocks reported as cached tokens), and a stream closed by its client
    leaves the groups serving the next requests."""
    client = openai.AsyncOpenAI(base_url=v1, api_key="x", max_retries=0, timeout=120)
    try:
        asked = [SHARED + [7, 8], SHARED + [9]]
        first = await client.completions.create(model="tiny", prompt=asked[0], max_tokens=NEW, temperature=0)
        second = await client.completions.create(model="tiny", prompt=asked[1], max_tokens=NEW, temperature=0)
        assert [first.choices[0].text, second.choices[0].text] == greedy.reference(model_dir, asked, NEW)
        details = second.usage.prompt_tokens_details if second.usage else None
        assert details is not None and details.cached_tokens == 48  # the shared blocks, cached by the first
        stream = await client.completions.create(
            model="tiny", prompt=PROMPTS[3], max_tokens=200, temperature=0, stream=True
        )
        async for _ in stream:
            break
        await stream.close()  # cancelled mid-stream
        assert await greedy.ask_all(v1, PROMPTS[:2], NEW) == greedy.reference(model_dir, PROMPTS[:2], NEW)
    finally:
        await client.close()
