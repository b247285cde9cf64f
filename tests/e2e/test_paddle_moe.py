"""`splitbus up` with the paddle engine and a tiny Mixtral: greedy text through a real prefill
worker, the KV hand-off over TCP and a real decode worker equals the engine's full recompute
(itself checked against a numpy reference in tests/worker/engines/paddle/test_moe.py). Kept
small: two layers, hidden 64, three prompts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import openai

from splitbus.gpu_ops import device

device.prepare()

from splitbus.tokenization import ModelTokenizer  # noqa: E402
from splitbus.worker.engines.paddle.model import Chunk, load_model  # noqa: E402
from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from splitbus.worker.text import TextStream  # noqa: E402
from tests.e2e.conftest import start_system, stop_system  # noqa: E402

NEW = 8


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(12)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in (1, 17, 40)]


def _reference(model_dir: Path) -> list[str]:
    model, tok = load_model(model_dir), ModelTokenizer.load(model_dir)
    texts = []
    for prompt in _prompts():
        tokens: list[int] = []
        for _ in range(NEW):
            tokens.append(int(np.argmax(model.forward([Chunk(prompt + tokens, 0)])[0])))
        stream = TextStream(tok, [])
        texts.append("".join(stream.push([t]) for t in tokens) + stream.flush())
    return texts


async def _ask_all(v1: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=v1, api_key="x", max_retries=0, timeout=120)

    async def one(prompt: list[int]) -> str:
        reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
        return reply.choices[0].text

    try:
        return await asyncio.gather(*(one(p) for p in _prompts()))
    finally:
        await client.close()


def test_mixtral_greedy_text_through_p_and_d_workers_matches_the_recompute(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tiny", "mixtral", seed=5, hidden=64, layers=2)
    reference = _reference(model_dir)
    assert all(reference)  # a text per prompt: the comparison below has something to compare
    system = start_system(tmp_path / "up", "--engine", "paddle", "--model", str(model_dir))
    try:
        assert asyncio.run(_ask_all(system.v1)) == reference
    finally:
        assert stop_system(system) == []
