"""Hugging Face safetensors -> the engine's layout, with every name and shape checked first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import paddle
from safetensors import safe_open

from splitbus.tokenization import ModelFilesError
from splitbus.worker.engines.paddle.config import ModelConfig


def expected_shapes(c: ModelConfig) -> dict[str, list[int]]:
    """Every tensor the model needs, HF layout (Linear weights are [out, in])."""
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": [c.vocab_size, c.hidden_size], "model.norm.weight": [c.hidden_size]}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = [c.vocab_size, c.hidden_size]
    for i in range(c.layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": [q, c.hidden_size],
                p + "self_attn.k_proj.weight": [kv, c.hidden_size],
                p + "self_attn.v_proj.weight": [kv, c.hidden_size],
                p + "self_attn.o_proj.weight": [c.hidden_size, q],
                p + "mlp.gate_proj.weight": [c.intermediate_size, c.hidden_size],
                p + "mlp.up_proj.weight": [c.intermediate_size, c.hidden_size],
                p + "mlp.down_proj.weight": [c.hidden_size, c.intermediate_size],
                p + "input_layernorm.weight": [c.hidden_size],
                p + "post_attention_layernorm.weight": [c.hidden_size],
            }
        )
        if c.qkv_bias:
            shapes.update(
                {p + "self_attn.q_proj.bias": [q], p + "self_attn.k_proj.bias": [kv], p + "self_attn.v_proj.bias": [kv]}
            )
    return shapes


def _files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFilesError(f"{folder} holds no *.safetensors file")
    return files


def _index(folder: Path) -> dict[str, tuple[Path, list[int]]]:
    found: dict[str, tuple[Path, list[int]]] = {}
    for path in _files(folder):
        try:
            with safe_open(str(path), framework="paddle") as f:
                for name in f.keys():
                    found[name] = (path, list(f.get_slice(name).get_shape()))
        except Exception as exc:  # safetensors raises its own error types
            raise ModelFilesError(f"{path} cannot be read: {exc}") from None
    return found


def check(folder: Path, config: ModelConfig) -> dict[str, Path]:
    """Where each needed tensor is; ModelFilesError naming the first problems otherwise."""
    found = _index(folder)
    problems = []
    for name, shape in expected_shapes(config).items():
        if name not in found:
            problems.append(f"missing tensor {name}")
        elif found[name][1] != shape:
            problems.append(f"tensor {name} has shape {found[name][1]}, expected {shape} from config.json")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ModelFilesError(f"{folder}: " + "; ".join(problems[:5]) + more)
    return {name: found[name][0] for name in expected_shapes(config)}


def load(folder: Path, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Each needed tensor as float32 numpy (bf16 and fp16 are converted on the CPU).

    safetensors' Paddle reader (the one that reads bf16) reinterprets bytes with a strided view,
    which the engine's CPU tuning switches off (FLAGS_use_stride_kernel=0); it is switched back
    on for the load only.
    """
    by_file: dict[Path, list[str]] = {}
    for name, path in check(folder, config).items():
        by_file.setdefault(path, []).append(name)
    with _stride_kernels():
        for path, names in by_file.items():
            with safe_open(str(path), framework="paddle") as f:
                for name in names:
                    yield name, f.get_tensor(name).astype(paddle.float32).numpy()


@contextlib.contextmanager
def _stride_kernels() -> Iterator[None]:
    flag = "FLAGS_use_stride_kernel"
    before = paddle.get_flags([flag])[flag]
    paddle.set_flags({flag: True})
    try:
        yield
    finally:
        paddle.set_flags({flag: before})
