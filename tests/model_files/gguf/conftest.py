from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from splitbus import architectures
from splitbus.gpu_ops import device

device.prepare()  # before paddle is imported (make_tiny_model's module imports the engine's)

from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402

ARCHS = tuple(a.model_type for a in architectures.registered() if a.gguf_layout)
"""Every registered architecture with a GGUF layout: a new one is converted and compared by every test here."""

ALL_MOE: dict[str, object] = {"mlp_only_layers": []}
"""llama.cpp's MoE layouts have experts in every layer (its ``qwen3moe`` loader requires a router in
each): the tiny Qwen3-MoE's dense layer 0 has no GGUF form, so its GGUF tests' model has none."""


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A small random Hugging Face folder per architecture (float32), made once per session; a MoE
    one has experts in every layer (``ALL_MOE``)."""
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            folder = tmp_path_factory.mktemp(arch) / "hf"
            made[arch] = make_tiny_model(folder, arch, seed=3, keys=ALL_MOE, hidden=64, layers=2)
        return made[arch]

    return make


@pytest.fixture(params=ARCHS)
def hf_folder(request: pytest.FixtureRequest, tiny_hf: Callable[[str], Path]) -> Path:
    return tiny_hf(request.param)
