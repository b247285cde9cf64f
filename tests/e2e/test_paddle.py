"""`splitbus up` with the paddle engine and a tiny model: the same greedy text from the P->D
path (KV over TCP) and from a mixed worker, equal to a local full-recompute reference."""

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

LENGTHS = (1, 15, 16, 17, 100)
NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("paddle") / "tiny", "llama", seed=3)


PROMPTS = greedy.prompts(11, LENGTHS)


def _serve(tmp_path: Path, model_dir: Path, *args: str) -> list[str]:
    system = start_system(tmp_path, "--engine", "paddle", "--model", str(model_dir), *args)
    try:
        texts = asyncio.run(greedy.ask_all(system.v1, PROMPTS, NEW))  # concurrent: shared batches
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
    reference = greedy.reference(model_dir, PROMPTS, NEW)
    assert _serve(tmp_path / "pd", model_dir) == reference
    assert _serve(tmp_path / "mixed", model_dir, "--mixed", "1") == reference
