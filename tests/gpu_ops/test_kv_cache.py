"""The paged KV cache moves a request's K and V between processes bit for bit in every dtype it
holds, in one copy each way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import paddle
import pytest

from splitbus.gpu_ops import kv_cache
from splitbus.gpu_ops.kv_cache import HOST_DTYPES, KVDtype, PagedKVCache

LAYERS, BLOCK, HEADS, DIM = 3, 4, 2, 8


def _filled(dtype: KVDtype, length: int, seed: int) -> tuple[PagedKVCache, list[int], np.ndarray]:
    """A cache holding a request of ``length`` random tokens, its block table, and its K and V
    as the host sees them: [layers, 2, length, heads, dim] in ``HOST_DTYPES[dtype]``."""
    cache = PagedKVCache(LAYERS, 16, BLOCK, HEADS, DIM, dtype)
    table = cache.allocator.allocate(-(-length // BLOCK))
    assert table is not None
    values = np.random.default_rng(seed).standard_normal((LAYERS, 2, length, HEADS, DIM)).astype(np.float32)
    on_device = paddle.to_tensor(values).astype(dtype)
    slots = paddle.to_tensor(cache.slots(table, 0, length))
    for layer in range(LAYERS):
        cache.write(layer, slots, on_device[layer, 0], on_device[layer, 1])
    return cache, table, on_device.numpy()


def _held(cache: PagedKVCache, table: list[int], start: int, end: int) -> np.ndarray:
    """Positions [start, end) of a request as the host sees them, gathered back from the pools."""
    slots = paddle.to_tensor(cache.slots(table, start, end))
    return np.stack([np.stack([t.numpy() for t in cache.gather(layer, slots)]) for layer in range(LAYERS)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # CPU paddle has no float16 index_select
def test_export_then_import_is_bit_exact_and_counts_its_bytes(dtype: KVDtype) -> None:
    length = 11
    src, table, values = _filled(dtype, length, seed=1)
    assert values.dtype == HOST_DTYPES[dtype] and _held(src, table, 0, length).tobytes() == values.tobytes()
    payload = src.export(table, length)
    assert src.bytes_per_token() == 2 * LAYERS * HEADS * DIM * (4 if dtype == "float32" else 2)
    assert len(payload) == src.bytes_per_token() * length
    assert payload == values.tobytes()  # every layer's K then V, position-major
    dst = PagedKVCache(LAYERS, 16, BLOCK, HEADS, DIM, dtype)
    dst.allocator.allocate(2)  # other block ids than the source's
    other = dst.allocator.allocate(3)
    assert other is not None and other != table
    dst.import_(other, length, payload)
    assert _held(dst, other, 0, length).tobytes() == values.tobytes()


def test_import_from_start_leaves_the_shared_positions_alone() -> None:
    src, table, values = _filled("bfloat16", 9, seed=2)
    dst, same_table, before = _filled("bfloat16", 9, seed=3)
    dst.import_(same_table, 9, src.export(table, 9), start=5)
    held = _held(dst, same_table, 0, 9)
    assert held[:, :, :5].tobytes() == before[:, :, :5].tobytes()
    assert held[:, :, 5:].tobytes() == values[:, :, 5:].tobytes()


def _counting(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[Any]:
    """Record the first argument of every call of ``owner.name`` (still calling it)."""
    calls: list[Any] = []
    real: Callable[..., Any] = getattr(owner, name)

    def counted(first: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(first)
        return real(first, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_export_gathers_once_per_pool_and_copies_to_the_host_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cache, table, values = _filled("bfloat16", 10, seed=4)
    gathers = _counting(monkeypatch, kv_cache.paddle, "index_select")
    concats = _counting(monkeypatch, kv_cache.paddle, "concat")
    copies = _counting(monkeypatch, paddle.Tensor, "numpy")
    assert cache.export(table, 10) == values.tobytes()
    assert len(gathers) == 2 * LAYERS and len(concats) == 1 and len(copies) == 1


def test_import_copies_to_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    src, table, values = _filled("float32", 10, seed=5)
    payload = src.export(table, 10)
    uploads = _counting(monkeypatch, kv_cache.paddle, "to_tensor")
    src.import_(table, 10, payload, start=2)
    rows = [a for a in uploads if a.dtype != np.int64]  # the other upload is the slot ids
    assert len(rows) == 1 and rows[0].nbytes == src.bytes_per_token() * 8


@pytest.mark.parametrize("rows", [kv_cache._view_of_rows, kv_cache._copy_of_rows])
def test_import_is_the_same_from_views_of_the_upload_or_from_copies(
    monkeypatch: pytest.MonkeyPatch, rows: Callable[[paddle.Tensor, int, int], paddle.Tensor]
) -> None:
    """Copies are the fallback for a Paddle without the private ``Tensor._slice``."""
    assert kv_cache._rows is kv_cache._view_of_rows  # this Paddle has it
    monkeypatch.setattr(kv_cache, "_rows", rows)
    taken = _counting(monkeypatch, kv_cache, "_rows")
    src, table, values = _filled("bfloat16", 10, seed=6)
    dst = PagedKVCache(LAYERS, 16, BLOCK, HEADS, DIM, "bfloat16")
    dst.import_(table, 10, src.export(table, 10), start=3)
    assert _held(dst, table, 3, 10).tobytes() == values[:, :, 3:].tobytes()
    assert len(taken) == 2 * LAYERS
