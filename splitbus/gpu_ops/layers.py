"""RoPE (rotate-half, as Llama and Qwen2 in Hugging Face), RMSNorm and SwiGLU's activation, in
Paddle's plain ops (``splitbus.gpu_ops.kernels`` swaps in fused kernels where the device has them)."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from splitbus.gpu_ops.kv_cache import KVDtype


def rope_tables(positions: np.ndarray, head_dim: int, theta: float) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos and sin, ``[T, 1, head_dim]``, with ``cos = concat(freqs, freqs)`` (not interleaved)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    freqs = np.outer(positions.astype(np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return paddle.to_tensor(np.cos(emb).astype(np.float32)), paddle.to_tensor(np.sin(emb).astype(np.float32))


class RopeTables:
    """cos and sin of every position up to a length, on the device: a step picks its positions'
    rows with one gather instead of computing them on the host. Made at load for the first
    ``length`` positions and doubled when a position past them comes (computed in float64 on the
    host then, as ``rope_tables`` does), in the model's ``dtype``."""

    def __init__(self, head_dim: int, theta: float, length: int, dtype: KVDtype = "float32") -> None:
        self.head_dim, self.theta, self.dtype = head_dim, theta, dtype
        self.cos, self.sin = self._tables(max(1, length))

    def _tables(self, length: int) -> tuple[paddle.Tensor, paddle.Tensor]:
        cos, sin = rope_tables(np.arange(length), self.head_dim, self.theta)
        return (cos, sin) if self.dtype == "float32" else (cos.astype(self.dtype), sin.astype(self.dtype))

    def at(self, positions: paddle.Tensor, last: int) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos and sin of ``positions`` (``[T]``, on the device), ``[T, 1, head_dim]``; ``last``:
        the largest of them, known on the host."""
        if last >= self.cos.shape[0]:
            self.cos, self.sin = self._tables(2 * last + 1)
        return paddle.index_select(self.cos, positions, axis=0), paddle.index_select(self.sin, positions, axis=0)


def apply_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """x ``[T, heads, head_dim]``."""
    first, second = paddle.split(x, 2, axis=-1)
    return x * cos + paddle.concat([-second, first], axis=-1) * sin


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    variance = paddle.mean(x * x, axis=-1, keepdim=True)
    return x * paddle.rsqrt(variance + eps) * weight


def silu_and_mul(gate_up: paddle.Tensor) -> paddle.Tensor:
    """SwiGLU's activation of the fused gate and up projections: ``silu(gate) * up``."""
    gate, up = paddle.split(gate_up, 2, axis=-1)
    return F.silu(gate) * up
