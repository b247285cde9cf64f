"""The paddle engine runs a converted GGUF model as it runs the Hugging Face original: the same
logits and greedy tokens from the same (F32) weights, for Llama and Mixtral (Q/K rows permuted in
the file, Mixtral's experts stacked under ``llama``), Qwen2, and Qwen3-MoE (``qwen3moe``, experts
stacked)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

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


def test_converted_model_gives_the_original_logits(hf_folder: Path, tmp_path: Path) -> None:
    """Every position's logits of a batch of prompts, to 1e-5: a wrong expert, router row or
    Q/K row order moves them far more."""
    folder = prepare(write_gguf(hf_folder, tmp_path / "m.gguf"), tmp_path / "cache")
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (3, 17)]
    chunks = [Chunk(prompt[:end], 0) for prompt in prompts for end in range(1, len(prompt) + 1)]
    original, converted = load_model(hf_folder).forward(chunks), load_model(folder).forward(chunks)
    assert original.shape == (len(chunks), 259) and np.abs(original).max() > 0.1
    np.testing.assert_allclose(converted, original, rtol=0, atol=1e-5)


def _expected_shapes(model_type: str) -> dict[str, tuple[int, ...]]:
    """The tensors of conftest's tiny models, worked out by hand from their ``config.json``
    (``tiny_config``: hidden 64, 2 layers, 4 heads and 2 KV heads of 64 / 4 = 16, intermediate
    2 x 64, the byte-level tokenizer's 259 tokens), not by the architecture's own table: Linear
    weights are [out, in]; q is 4 x 16 = 64 wide, k and v 2 x 16 = 32; Qwen2 has q/k/v biases
    and ties its output to the embedding (no ``lm_head``), Llama neither."""
    qwen2 = model_type == "qwen2"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (259, 64), "model.norm.weight": (64,)}
    if not qwen2:
        shapes["lm_head.weight"] = (259, 64)
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (64, 64),
            p + "self_attn.k_proj.weight": (32, 64),
            p + "self_attn.v_proj.weight": (32, 64),
            p + "self_attn.o_proj.weight": (64, 64),
            p + "mlp.gate_proj.weight": (128, 64),
            p + "mlp.up_proj.weight": (128, 64),
            p + "mlp.down_proj.weight": (64, 128),
            p + "input_layernorm.weight": (64,),
            p + "post_attention_layernorm.weight": (64,),
        }
        if qwen2:
            shapes |= {p + "self_attn.q_proj.bias": (64,), p + "self_attn.k_proj.bias": (32,)}
            shapes |= {p + "self_attn.v_proj.bias": (32,)}
    return shapes


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_shapes_are_the_ones_worked_out_by_hand(model_type: str, tiny_hf: Callable[[str], Path]) -> None:
    raw = json.loads((tiny_hf(model_type) / "config.json").read_text())
    assert weights.hf_shapes(raw) == _expected_shapes(model_type)


def test_shapes_are_the_engines(hf_folder: Path) -> None:
    """weights.hf_shapes is the layout the engine's loader checks."""
    raw = json.loads((hf_folder / "config.json").read_text())
    assert list(engine_weights.check(hf_folder, config_from(raw))) == list(weights.hf_shapes(raw))
