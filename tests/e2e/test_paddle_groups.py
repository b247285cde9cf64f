"""The paddle engine in EP + PD groups: a prefill group of 2 ranks and a decode group of 2 under
`splitbus up` give the same greedy text as a mixed worker's engine, the KV going from a prefill
rank to a decode rank over TCP, streamed and not."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import cast

import numpy as np
import openai
import pytest

from splitbus.bus.core.keys import Keys
from splitbus.gpu_ops import device

device.prepare()  # the CPU tuning comes before paddle's import

from splitbus.bus.messages import GenerateRequest, SamplingParams, Task  # noqa: E402
from splitbus.tokenization import ModelTokenizer  # noqa: E402
from splitbus.worker.engines.paddle.engine import PaddleEngine  # noqa: E402
from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from splitbus.worker.sequence import Sequence  # noqa: E402
from splitbus.worker.text import TextStream  # noqa: E402
from tests.e2e.conftest import System, start_system, stop_system  # noqa: E402

LENGTHS = (1, 16, 17, 60)
NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("paddle") / "tiny", "llama", seed=3)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in LENGTHS]


async def _mixed_engine(model_dir: Path) -> list[str]:
    """What a mixed worker's engine makes of the prompts: one prefill batch, then decode steps of
    all of them together (the worker loop's path, without the bus)."""
    tok = ModelTokenizer.load(model_dir)
    engine = PaddleEngine.load(model_dir, tok.eos_token_ids, total_blocks=64, block_size=16)
    batch = []
    for i, prompt in enumerate(_prompts()):
        request = GenerateRequest(f"r{i}", "tiny", prompt, SamplingParams(max_tokens=NEW, temperature=0.0), "api", 0)
        batch.append(Sequence(Task("mixed", request), "0-0", TextStream(tok, [])))
        assert engine.reserve(batch[-1], len(prompt) + NEW)
    outputs = [[token] for token in await engine.prefill(batch)]
    for seq, out in zip(batch, outputs, strict=True):
        seq.output_ids.append(out[0])
    while len(outputs[0]) < NEW:
        for seq, out, token in zip(batch, outputs, await engine.decode(batch), strict=True):
            seq.output_ids.append(token)
            out.append(token)
    assert not any(t in tok.eos_token_ids for out in outputs for t in out)  # else the API's texts stop early
    return [_text(tok, out) for out in outputs]


def _text(tok: ModelTokenizer, tokens: list[int]) -> str:
    stream = TextStream(tok, [])
    return "".join(stream.push([t]) for t in tokens) + stream.flush()


async def _ask_all(system: System) -> tuple[list[str], list[str]]:
    """Every prompt twice at once, streamed and not (greedy): both groups get several requests."""
    client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=120)

    async def whole(prompt: list[int]) -> str:
        reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage and reply.usage.completion_tokens == NEW
        return reply.choices[0].text

    async def streamed(prompt: list[int]) -> str:
        chunks = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in chunks])

    try:
        texts = await asyncio.gather(*(whole(p) for p in _prompts()), *(streamed(p) for p in _prompts()))
        return list(texts[: len(LENGTHS)]), list(texts[len(LENGTHS) :])
    finally:
        await client.close()


def _ranks(system: System) -> dict[tuple[str, str], dict[str, str]]:
    r = system.redis()  # decodes: every reply is str
    records = [
        cast(dict[str, str], r.hgetall(Keys().worker(w))) for w in cast(list[str], r.zrange(Keys().workers, 0, -1))
    ]
    return {(h["dp_group"], h["dp_rank"]): h for h in records}


def _settled(system: System) -> dict[tuple[str, str], dict[str, str]]:
    """The ranks once the heartbeats (every 0.5 s) have published every request and each group's
    ranks agree on their steps; as they are after 5 s otherwise. A bounded wait, not a sleep."""
    deadline = time.monotonic() + 5
    while True:
        ranks = _ranks(system)
        by_role = {role: [h for h in ranks.values() if h["role"] == role] for role in ("prefill", "decode")}
        done = [sum(int(h[f"{role}s_done"]) for h in records) for role, records in by_role.items()]
        agree = all(len({h["steps"] for h in records}) == 1 for records in by_role.values())
        if (done == [2 * len(LENGTHS)] * 2 and agree) or time.monotonic() > deadline:
            return ranks
        time.sleep(0.1)


def test_prefill_and_decode_groups_match_a_mixed_worker(tmp_path: Path, model_dir: Path) -> None:
    reference = asyncio.run(_mixed_engine(model_dir))
    groups = ("--prefill", "1", "--prefill-dp", "2", "--decode", "1", "--decode-dp", "2")
    system = start_system(tmp_path, "--engine", "paddle", "--model", str(model_dir), *groups)
    try:
        whole, streamed = asyncio.run(_ask_all(system))
        assert whole == reference
        assert streamed == reference
        ranks = _settled(system)
        assert sorted(ranks) == [("d0", "0"), ("d0", "1"), ("p0", "0"), ("p0", "1")]
        for group, role, done in (("p0", "prefill", "prefills_done"), ("d0", "decode", "decodes_done")):
            records = [ranks[group, rank] for rank in "01"]
            assert {h["role"] for h in records} == {role}
            assert sum(int(h[done]) for h in records) == 2 * len(LENGTHS)
            # Every rank ran each of its group's steps, as an idle forward where it had no work.
            assert len({int(h["steps"]) for h in records}) == 1, records
    finally:
        assert stop_system(system) == []
