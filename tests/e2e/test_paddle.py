"""`splitbus up` with the paddle engine and a tiny model: the same greedy text from the P->D
path (KV over TCP) and from a mixed worker, equal to a local full-recompute reference."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import openai
import pytest

from splitbus.gpu_ops import device

device.prepare()

from splitbus.tokenization import ModelTokenizer  # noqa: E402
from splitbus.worker.engines.paddle.model import Chunk, load_model  # noqa: E402
from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from splitbus.worker.text import TextStream  # noqa: E402
from tests.e2e.conftest import System, start_system, stop_system  # noqa: E402

LENGTHS = (1, 15, 16, 17, 100)
NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("paddle") / "tiny", "llama", seed=3)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in LENGTHS]


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


async def _ask_all(system: System) -> list[str]:
    client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=120)

    async def one(prompt: list[int]) -> str:
        reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
        return reply.choices[0].text

    try:
        # Concurrent: the five are prefilled and decoded in shared batches.
        return await asyncio.gather(*(one(p) for p in _prompts()))
    finally:
        await client.close()


def _serve(tmp_path: Path, model_dir: Path, *args: str) -> list[str]:
    system = start_system(tmp_path, "--engine", "paddle", "--model", str(model_dir), *args)
    try:
        texts = asyncio.run(_ask_all(system))
        client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=6, stream=True, seed=1))
        assert sum(1 for c in chunks if c.choices[0].text) >= 1 and chunks[-1].choices[0].finish_reason in (
            "length",
            "stop",
        )
        return texts
    finally:
        assert stop_system(system) == []


def test_pd_over_tcp_matches_mixed_and_reference(tmp_path: Path, model_dir: Path) -> None:
    reference = _reference(model_dir)
    assert _serve(tmp_path / "pd", model_dir) == reference
    assert _serve(tmp_path / "mixed", model_dir, "--mixed", "1") == reference
