"""`splitbus up` with the paddle engine and a tiny Mixtral: greedy text through a real prefill
worker, the KV hand-off over TCP and a real decode worker equals the engine's full recompute
(itself checked against a numpy reference in tests/worker/engines/paddle/test_moe.py); and a
tiny Qwen3-MoE served from its GGUF file (llama.cpp's ``qwen3moe`` layout, experts stacked)
answers as its Hugging Face folder does. Kept small: two layers, hidden 64, three prompts."""

from __future__ import annotations

import asyncio
from pathlib import Path

from splitbus.gpu_ops import device

device.prepare()

from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from tests.e2e import greedy  # noqa: E402
from tests.e2e.conftest import start_system, stop_system  # noqa: E402
from tests.model_files.gguf.writer import write_gguf  # noqa: E402

NEW = 8


PROMPTS = greedy.prompts(12, (1, 17, 40))


def test_mixtral_greedy_text_through_p_and_d_workers_matches_the_recompute(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tiny", "mixtral", seed=5, hidden=64, layers=2)
    reference = greedy.reference(model_dir, PROMPTS, NEW)
    assert all(reference)  # a text per prompt: the comparison below has something to compare
    system = start_system(tmp_path / "up", "--engine", "paddle", "--model", str(model_dir))
    try:
        assert asyncio.run(greedy.ask_all(system.v1, PROMPTS, NEW)) == reference
    finally:
        assert stop_system(system) == []


def test_qwen3_moe_gguf_greedy_text_through_p_and_d_workers_matches_its_folder(tmp_path: Path) -> None:
    """The file is converted once by ``up`` (into the data folder) and both workers load it."""
    model_dir = make_tiny_model(
        tmp_path / "tiny", "qwen3_moe", seed=6, keys={"mlp_only_layers": []}, hidden=64, layers=2
    )
    gguf_file = write_gguf(model_dir, tmp_path / "tiny.gguf")  # F32; served as "tiny", its stem
    reference = greedy.reference(model_dir, PROMPTS, NEW)
    assert all(reference)
    system = start_system(tmp_path / "up", "--engine", "paddle", "--model", str(gguf_file))
    try:
        assert asyncio.run(greedy.ask_all(system.v1, PROMPTS, NEW)) == reference
    finally:
        assert stop_system(system) == []
