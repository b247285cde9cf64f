"""A Hugging Face ``config.json`` for Llama or Qwen2, read and checked once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from splitbus.tokenization import ModelFilesError

KV_DTYPE: Final = "float32"
"""The KV cache's dtype: the model computes in float32 (bf16 and fp16 weights are converted as
they load), so its K and V are float32. Sizing (``kv_blocks``) and the cache (``new_cache``) both
read it."""
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def load(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelFilesError(f"{path} is missing") from None
        except ValueError as exc:
            raise ModelFilesError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: Path | str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelFilesError(
                f"{where}: architecture {archs or 'missing'} is not supported; expected one of {sorted(ARCHITECTURES)}"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            config = cls(
                arch=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                layers=int(raw["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 has q/k/v biases although its config has no attention_bias key.
                qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            )
        except KeyError as exc:
            raise ModelFilesError(f"{where}: missing key {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ModelFilesError(f"{where}: bad value: {exc}") from None
        if config.heads % config.kv_heads:
            raise ModelFilesError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
        return config


def _rope_theta(raw: dict[str, Any]) -> float:
    """Newer transformers configs keep it under rope_parameters."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(raw.get("rope_theta", 10000.0))
