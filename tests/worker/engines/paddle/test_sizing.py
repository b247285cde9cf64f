"""The paddle engine's KV cache, built through the registry, is the size its budget allows: given,
or the CPU's default, or what the worker's fraction of a GPU leaves once its weights are loaded (the
GPU faked: this machine has none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest

from splitbus.architectures import load_config
from splitbus.gpu_ops import device
from splitbus.tokenization import ModelTokenizer
from splitbus.worker import engines
from splitbus.worker.engines import EngineSetup, kv_bytes_per_token
from splitbus.worker.engines.paddle import CPU_KV_CACHE_BYTES, KV_DTYPE, KV_SHARE, kv_blocks, kv_budget
from splitbus.worker.engines.paddle.dtypes import compute_dtype
from splitbus.worker.engines.paddle.engine import PaddleEngine
from splitbus.worker.engines.paddle.tiny import make_tiny_model

MIB = 2**20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sizing") / "m", "llama", seed=2)


def _engine(model_dir: Path, **setup: Any) -> PaddleEngine:
    engine = engines.create("paddle", EngineSetup(model_dir, ModelTokenizer.load(model_dir), **setup))
    assert isinstance(engine, PaddleEngine)
    return engine


def test_the_cache_fills_its_budget_in_the_engines_own_dtype(model_dir: Path) -> None:
    config = load_config(model_dir)
    engine = _engine(model_dir, kv_cache_bytes=3 * MIB)
    cache = engine.cache
    assert cache.dtype == KV_DTYPE
    assert cache.bytes_per_token() == kv_bytes_per_token(config.layers, config.kv_heads, config.head_dim, KV_DTYPE)
    assert engine.total_blocks == kv_blocks(config, 3 * MIB, 16) - 1 == 47  # block 0 is scratch
    held = sum(int(np.prod(pool.shape)) * np.dtype(KV_DTYPE).itemsize for pool in cache.k + cache.v)
    assert held <= 3 * MIB < held + cache.bytes_per_token() * 16  # not one more block would fit


def test_kv_blocks_given_are_taken_as_they_are(model_dir: Path) -> None:
    assert _engine(model_dir, kv_blocks=10, block_size=32).total_blocks == 9


def test_without_a_budget_the_cpu_takes_256_mib_and_a_gpu_90_percent_of_its_fraction_less_its_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device, "gpu_memory", lambda where: {"gpu:1": (10_000 * MIB, 1_000 * MIB)}.get(where))
    assert kv_budget("cpu", None) == kv_budget("cpu", None, 0.45) == CPU_KV_CACHE_BYTES == 256 * MIB
    assert kv_budget("gpu:1", None) == int((9_000 - 1_000) * MIB * KV_SHARE) == 7_200 * MIB  # alone: 0.9
    assert kv_budget("gpu:1", None, 0.45) == int((4_500 - 1_000) * MIB * KV_SHARE) == 3_150 * MIB  # one of two
    assert kv_budget("gpu:1", None, 0.05) == 0  # its share does not hold its weights
    assert kv_budget("gpu:1", 5 * MIB) == kv_budget("cpu", 5 * MIB) == 5 * MIB  # --kv-cache-mb wins


def _on_a_fake_gpu(monkeypatch: pytest.MonkeyPatch, total: int, held: int, bf16: bool) -> list[str]:
    """The engine believes it runs on ``gpu:1`` of ``total`` bytes, holding ``held`` of them once
    its weights are loaded (Paddle still computes on the CPU); the devices it asked for, recorded."""
    asked: list[str] = []
    monkeypatch.setattr(device, "select_device", lambda threads, spec: asked.append(spec) or "gpu:1")
    monkeypatch.setattr(device, "gpu_memory", lambda where: (total, held) if where == "gpu:1" else None)
    monkeypatch.setattr(device, "computes_bf16", lambda where: bf16 and where == "gpu:1")
    return asked


@pytest.mark.parametrize(("bf16", "dtype", "blocks"), [(False, "float32", 47), (True, "bfloat16", 95)])
def test_on_a_gpu_the_cache_fills_its_share_in_the_compute_dtype(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, bf16: bool, dtype: str, blocks: int
) -> None:
    config = load_config(model_dir)
    # Half of a GPU, less 1 MiB of weights, leaves 3 MiB for the cache once the activations' 10% are kept.
    total = int(2 * (3 * MIB / KV_SHARE + MIB)) + 2
    asked = _on_a_fake_gpu(monkeypatch, total=total, held=MIB, bf16=bf16)
    engine = _engine(model_dir, device="gpu:1", gpu_memory_fraction=0.5)
    assert asked == ["gpu:1"]
    assert engine.model.dtype == engine.cache.dtype == dtype and engine.model.embed.dtype == getattr(paddle, dtype)
    assert engine.total_blocks == kv_blocks(config, 3 * MIB, 16, dtype) - 1 == blocks  # bf16: twice the tokens
    alone = _engine(model_dir, device="gpu:1").total_blocks  # the default, 0.9 of the GPU
    assert alone == kv_blocks(config, kv_budget("gpu:1", None), 16, dtype) - 1 > 2 * blocks
    assert _engine(model_dir, device="gpu:1", kv_cache_bytes=MIB).total_blocks == kv_blocks(config, MIB, 16, dtype) - 1


def test_a_share_of_a_gpu_too_small_for_two_blocks_is_a_clear_error(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _on_a_fake_gpu(monkeypatch, total=100 * MIB, held=10 * MIB, bf16=False)
    with pytest.raises(
        ValueError,
        match=r"budget, 0\.0 MiB, holds 0 block\(s\) of 16 tokens; it needs 2 .*"
        r"give more --kv-cache-mb, or more --gpu-memory-fraction on a GPU",
    ):
        _engine(model_dir, device="gpu:1", gpu_memory_fraction=0.1)  # 10 MiB: all weights


def test_a_fraction_outside_0_to_1_is_refused(model_dir: Path) -> None:
    for fraction in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"the GPU memory fraction must be in \(0, 1\]"):
            EngineSetup(model_dir, ModelTokenizer.load(model_dir), gpu_memory_fraction=fraction)


def test_the_cpu_never_computes_in_bf16(model_dir: Path) -> None:
    assert compute_dtype("cpu") == KV_DTYPE == "float32"
    assert _engine(model_dir, device="cpu").model.dtype == "float32"
