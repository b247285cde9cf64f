"""The paddle engine runs a converted GGUF model as it runs the Hugging Face original: the same
greedy tokens from the same (F32) weights, for Llama (Q/K rows permuted in the file) and Qwen2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from splitbus.architectures import config_from
from splitbus.model_files.gguf import prepare, weights
from splitbus.worker.engines.paddle import weights as engine_weights
from splitbus.worker.engines.paddle.model import CausalLM, Chunk, load_model
from tests.model_files.gguf.writer import write_gguf

NEW_TOKENS = 8


def _greedy(model: CausalLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        tokens: list[int] = []
        for _ in range(NEW_TOKENS):
            tokens.append(int(np.argmax(model.forward([Chunk(prompt + tokens, 0)])[0])))
        outputs.append(tokens)
    return outputs


def test_converted_model_gives_the_original_greedy_tokens(hf_folder: Path, tmp_path: Path) -> None:
    folder = prepare(write_gguf(hf_folder, tmp_path / "m.gguf"), tmp_path / "cache")
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (1, 9, 33)]
    original = _greedy(load_model(hf_folder), prompts)
    assert _greedy(load_model(folder), prompts) == original
    assert len({tuple(t) for t in original}) > 1  # the prompts lead somewhere different: a real check


def test_shapes_are_the_engines(hf_folder: Path) -> None:
    """weights.hf_shapes is the layout the engine's loader checks: both read the architecture's."""
    raw = json.loads((hf_folder / "config.json").read_text())
    config = config_from(raw)
    raw |= {"head_dim": config.head_dim, "attention_bias": False}
    assert weights.hf_shapes(raw) == {name: tuple(shape) for name, shape in config.tensor_shapes().items()}
    assert list(engine_weights.check(hf_folder, config)) == list(weights.hf_shapes(raw))
