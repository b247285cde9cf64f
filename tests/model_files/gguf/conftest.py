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


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A small random Hugging Face folder per architecture (float32), made once per session."""
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(arch) / "hf", arch, seed=3, hidden=64, layers=2)
        return made[arch]

    return make


@pytest.fixture(params=ARCHS)
def hf_folder(request: pytest.FixtureRequest, tiny_hf: Callable[[str], Path]) -> Path:
    return tiny_hf(request.param)
