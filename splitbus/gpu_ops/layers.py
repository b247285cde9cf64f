"""RoPE (rotate-half, as Llama and Qwen2 in Hugging Face) and RMSNorm."""

from __future__ import annotations

import numpy as np
import paddle


def rope_tables(positions: np.ndarray, head_dim: int, theta: float) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos and sin, ``[T, 1, head_dim]``, with ``cos = concat(freqs, freqs)`` (not interleaved)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    freqs = np.outer(positions.astype(np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return paddle.to_tensor(np.cos(emb).astype(np.float32)), paddle.to_tensor(np.sin(emb).astype(np.float32))


def apply_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """x ``[T, heads, head_dim]``."""
    first, second = paddle.split(x, 2, axis=-1)
    return x * cos + paddle.concat([-second, first], axis=-1) * sin


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    variance = paddle.mean(x * x, axis=-1, keepdim=True)
    return x * paddle.rsqrt(variance + eps) * weight
