"""Qwen2 (``Qwen2ForCausalLM``, Qwen2.5 too): Llama's decoder with q/k/v biases always; llama.cpp
runs it with NeoX RoPE (halves), so its GGUF rows are not permuted."""

from __future__ import annotations

from splitbus.architectures import register
from splitbus.architectures.base import Architecture

QWEN2 = register(
    Architecture("Qwen2ForCausalLM", model_type="qwen2", gguf_name="qwen2", qkv_bias=True, tiny_ties_embeddings=True)
)
