"""gpu_ops against plain numpy references."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from splitbus.gpu_ops.attention import attention, causal_mask
from splitbus.gpu_ops.kv_cache import BlockAllocator, PagedKVCache
from splitbus.gpu_ops.layers import apply_rope, rms_norm, rope_tables
from splitbus.gpu_ops.sampling import sample


def _reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_offset: int) -> np.ndarray:
    seq, heads, dim = q.shape
    group = heads // k.shape[1]
    out = np.zeros((seq, heads * dim), np.float64)
    for i in range(seq):
        for h in range(heads):
            scores = k[:, h // group] @ q[i, h] / np.sqrt(dim)
            scores[np.arange(k.shape[0]) > q_offset + i] = -np.inf
            p = np.exp(scores - scores.max())
            out[i, h * dim : (h + 1) * dim] = (p / p.sum()) @ v[:, h // group]
    return out


@pytest.mark.parametrize("queries, keys", [(5, 5), (1, 9), (3, 9), (1, 1)])
def test_attention_matches_reference_with_gqa_and_bottom_right_mask(queries: int, keys: int) -> None:
    rng = np.random.default_rng(queries * 10 + keys)
    q = rng.standard_normal((queries, 8, 16)).astype(np.float32)
    k, v = (rng.standard_normal((keys, 2, 16)).astype(np.float32) for _ in range(2))
    offset = keys - queries
    got = attention(paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), offset).numpy()
    np.testing.assert_allclose(got, _reference_attention(q, k, v, offset), atol=1e-5)


def test_mask_lets_each_query_see_its_prefix() -> None:
    mask = causal_mask(2, 4, q_offset=2)
    assert (mask == 0).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_rope_is_rotate_half_and_rms_norm() -> None:
    x = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(np.float32)
    cos, sin = rope_tables(np.array([0, 1, 5]), 8, 10000.0)
    got = apply_rope(paddle.to_tensor(x), cos, sin).numpy()
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    angles = np.outer([0, 1, 5], np.concatenate([inv, inv]))[:, None, :]
    rotated = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
    np.testing.assert_allclose(got, x * np.cos(angles) + rotated * np.sin(angles), atol=1e-5)
    w = np.linspace(0.5, 1.5, 8).astype(np.float32)
    flat = x.reshape(-1, 8)
    expected = flat / np.sqrt((flat**2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(rms_norm(paddle.to_tensor(flat), paddle.to_tensor(w), 1e-6).numpy(), expected, atol=1e-5)


def test_block_allocator_never_hands_out_block_zero() -> None:
    alloc = BlockAllocator(5)
    taken = alloc.allocate(4)
    assert taken is not None and 0 not in taken and alloc.free == 0
    assert alloc.allocate(1) is None
    alloc.release(taken[:2])
    assert alloc.free == 2


def test_export_import_moves_a_request_to_other_blocks() -> None:
    rng = np.random.default_rng(3)
    src, dst = PagedKVCache(2, 16, 4, 2, 8), PagedKVCache(2, 16, 4, 2, 8)
    table_src = src.allocator.allocate(5)
    dst.allocator.allocate(3)  # the destination hands out different ids
    table_dst = dst.allocator.allocate(5)
    assert table_src != table_dst
    length = 17
    k, v = (rng.standard_normal((length, 2, 8)).astype(np.float32) for _ in range(2))
    slots = paddle.to_tensor(src.slots(table_src, 0, length))
    for layer in range(2):
        src.write(layer, slots, paddle.to_tensor(k * (layer + 1)), paddle.to_tensor(v))
    payload = src.export(table_src, length)
    assert len(payload) == length * src.bytes_per_token()
    dst.import_(table_dst, length, payload)
    got_k, got_v = dst.gather(1, paddle.to_tensor(dst.slots(table_dst, 0, length)))
    np.testing.assert_array_equal(got_k.numpy(), k * 2)
    np.testing.assert_array_equal(got_v.numpy(), v)
    with pytest.raises(ValueError, match="expected"):
        dst.import_(table_dst, length, payload[:-4])


def test_sampling_is_counter_based_and_respects_top_k_top_p() -> None:
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert sample(logits, 0.0, 0, 1.0, seed=1, step=0) == int(np.argmax(logits))
    draws = [sample(logits, 1.0, 0, 1.0, seed=9, step=s) for s in range(50)]
    assert draws == [sample(logits, 1.0, 0, 1.0, seed=9, step=s) for s in range(50)]  # no hidden state
    assert len(set(draws)) > 10
    top5 = set(np.argsort(-logits)[:5].tolist())
    assert all(sample(logits, 1.0, 5, 1.0, 3, s) in top5 for s in range(100))
    peaked = np.full(10, -10.0, np.float32)
    peaked[[2, 7]] = [5.0, 4.0]
    assert {sample(peaked, 1.0, 0, 0.5, 4, s) for s in range(100)} == {2}  # top-p keeps the head
    ties = np.zeros(6, np.float32)
    assert sample(ties, 0.0, 0, 1.0, 0, 0) == 0 and sample(ties, 1.0, 1, 1.0, 0, 0) == 0  # ties by id
