"""``splitbus make-tiny-model``: a small random model in Hugging Face layout (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a chat template)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from splitbus import architectures
from splitbus.tokenization.byte_level import write_byte_level_tokenizer


def tiny_config(
    arch: str,
    vocab_size: int,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    keys: dict[str, object] | None = None,
) -> dict[str, object]:
    """The ``config.json`` of a tiny model of the architecture whose ``model_type`` is ``arch``;
    ``keys`` replace its values (a Qwen3-MoE without dense layers: ``{"mlp_only_layers": []}``)."""
    architecture = architectures.of_model_type(arch)
    return (
        {
            "architectures": [architecture.hf_name],
            "model_type": architecture.model_type,
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": hidden * 2,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": architecture.tiny_ties_embeddings,
            "torch_dtype": "float32",
            "eos_token_id": vocab_size - 1,
        }
        | architecture.tiny_keys(hidden)
        | (keys or {})
    )


def make_tiny_model(
    folder: Path,
    arch: str = architectures.DEFAULT,
    seed: int = 0,
    dtype: str = "float32",
    keys: dict[str, object] | None = None,
    **sizes: int,
) -> Path:
    """Write the model; returns the folder. ``dtype`` bfloat16 exercises the conversion path;
    ``keys`` replace ``config.json`` values (``tiny_config``)."""
    architectures.of_model_type(arch)  # ValueError naming the known ones, before anything is written
    vocab = write_byte_level_tokenizer(folder)
    raw = tiny_config(arch, vocab, keys=keys, **sizes)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab - 1}) + "\n")
    config = architectures.config_from(raw)
    rng = np.random.default_rng(seed)
    tensors = {name: _init(name, shape, rng) for name, shape in config.tensor_shapes().items()}
    _save(tensors, folder / "model.safetensors", dtype)
    return folder


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("norm.weight") or "layernorm" in name:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (0.08 * rng.standard_normal(shape)).astype(np.float32)


def _save(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    if dtype == "float32":
        from safetensors.numpy import save_file

        save_file(tensors, str(path))
        return
    import paddle
    from safetensors.paddle import save_file as save_paddle

    as_dtype = getattr(paddle, dtype)  # paddle.bfloat16: astype's stubs take no plain str
    save_paddle({k: paddle.to_tensor(v).astype(as_dtype) for k, v in tensors.items()}, str(path))
