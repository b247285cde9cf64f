"""The paddle engine's KV cache, built through the registry, is the size its budget allows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from splitbus.architectures import load_config
from splitbus.tokenization import ModelTokenizer
from splitbus.worker import engines
from splitbus.worker.engines import EngineSetup, kv_bytes_per_token
from splitbus.worker.engines.paddle import KV_DTYPE, kv_blocks
from splitbus.worker.engines.paddle.engine import PaddleEngine
from splitbus.worker.engines.paddle.tiny import make_tiny_model

MIB = 2**20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sizing") / "m", "llama", seed=2)


def _engine(model_dir: Path, **setup: int) -> PaddleEngine:
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
