"""Attention for one sequence, grouped-query without repeating K/V.

Queries sit at absolute positions ``q_offset .. q_offset + S - 1`` and keys at ``0 .. L - 1``;
query i sees key j when ``j <= q_offset + i``. The mask is explicit and aligned bottom-right, so
it is right when queries are fewer than keys (decode, chunked prefill, prefix reuse) — unlike a
top-left ``is_causal``.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F


def causal_mask(queries: int, keys: int, q_offset: int) -> np.ndarray:
    rows = np.arange(queries)[:, None] + q_offset
    return np.where(np.arange(keys)[None, :] <= rows, 0.0, -np.inf).astype(np.float32)


def attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, q_offset: int) -> paddle.Tensor:
    """q ``[S, H, D]``, k and v ``[L, Hkv, D]`` -> ``[S, H * D]``."""
    seq, heads, dim = q.shape
    keys, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    # [S, Hkv, G, D] -> [Hkv, G*S, D]: each KV head serves its G query heads in one matmul.
    qh = q.reshape([seq, kv_heads, group, dim]).transpose([1, 2, 0, 3]).reshape([kv_heads, group * seq, dim])
    scores = paddle.matmul(qh, k.transpose([1, 0, 2]), transpose_y=True) * (dim**-0.5)
    if seq > 1 or q_offset + 1 < keys:
        mask = np.tile(causal_mask(seq, keys, q_offset), (group, 1))
        scores = scores + paddle.to_tensor(mask).astype(scores.dtype)
    out = paddle.matmul(F.softmax(scores, axis=-1), v.transpose([1, 0, 2]))
    return out.reshape([kv_heads, group, seq, dim]).transpose([2, 0, 1, 3]).reshape([seq, heads * dim])
