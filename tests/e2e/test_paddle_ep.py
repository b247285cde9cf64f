"""Expert parallelism end to end: `splitbus up --engine paddle --ep` with a prefill group and a
decode group, each of 2 or 4 ranks holding a share of a tiny MoE model's experts (gloo on
loopback, formed through `sb:ep:{group}`). Greedy text through P group -> KV over TCP -> D group
equals the engine's full recompute on one model holding every expert (itself checked against a
numpy reference in tests/worker/engines/paddle/test_moe.py). Kept small: two layers, hidden 64."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import openai
import pytest

from splitbus import architectures
from splitbus.bus.core.config import BusConfig
from splitbus.bus.records import ExpertLoad
from splitbus.bus.registry import WorkerRecord
from splitbus.gpu_ops import device

device.prepare()

from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from tests.e2e import greedy  # noqa: E402
from tests.e2e.conftest import System, start_system, stop_system  # noqa: E402

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
        _expert_loads_add_up(system, ranks, model_dir)
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


def _group_loads(system: System, group: str) -> list[ExpertLoad]:
    """The expert loads the group's ranks last wrote into their registry hashes, in rank order."""
    client, keys = system.redis(), BusConfig(redis_url=system.redis_url).keys
    records = [WorkerRecord.from_hash(client.hgetall(keys.worker(w))) for w in client.zrange(keys.workers, 0, -1)]
    ranks = sorted((r for r in records if r.dp_group == group), key=lambda r: r.dp_rank)
    assert all(r.load.experts is not None for r in ranks)
    return [r.load.experts for r in ranks if r.load.experts is not None]


def _expert_loads_add_up(system: System, ranks: int, model_dir: Path) -> None:
    """Each group's ranks hold disjoint shares covering the model's 4 experts, with the same dense
    weights; every token the group forwarded filled its expert slots once, whichever rank holds
    them: the group's counts add up to a multiple of a token's slots, and the prefill group's to
    at least its prompts' (idle forwards add one token each). Heartbeats write the last steps'
    loads within 0.5 s."""
    experts = architectures.config_from(json.loads((model_dir / "config.json").read_text())).experts
    assert experts is not None
    routed = experts.per_token * len(experts.layers)  # the expert slots one token fills in a forward
    prompt_slots = sum(map(len, PROMPTS)) * routed
    deadline = time.monotonic() + 5
    while True:
        prefill, decode = _group_loads(system, "p0"), _group_loads(system, "d0")
        sums = [sum(sum(load.total) for load in loads) for loads in (prefill, decode)]
        if (sums[0] >= prompt_slots and not sums[0] % routed and not sums[1] % routed) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sums[0] >= prompt_slots and sums[1] > 0 and not sums[0] % routed and not sums[1] % routed
    for loads in (prefill, decode):
        assert len(loads) == ranks and all(load.experts == 4 for load in loads)
        assert [e for load in loads for e in range(*load.held)] == [0, 1, 2, 3]
        assert len({load.weight_bytes[0] for load in loads}) == 1 and all(load.weight_bytes[1] > 0 for load in loads)
