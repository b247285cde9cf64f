"""Paged KV cache: per-layer flat pools ``[num_blocks * block_size, kv_heads, head_dim]``.

A request owns a list of blocks (its block table); position p lives in slot
``table[p // block_size] * block_size + p % block_size``. Block 0 is never handed out: it is
the scratch block that padding may write to.

A 16-bit pool (bfloat16, float16) is written with ``index_put_``: Paddle's CPU ``scatter`` has no
16-bit kernel (3.3.1: float32, float64, int32, int64; ``index_put_`` has bfloat16, ~67 µs for 128
tokens against ``scatter_``'s ~6 µs in float32, and only a GPU computes in bfloat16). Its bytes
cross processes as a 2-byte unsigned view (numpy has no bfloat16; Paddle's ``Tensor.numpy()``
gives a bfloat16 tensor's bits as uint16 and ``paddle.to_tensor`` reads uint16 back as
bfloat16). Paddle's CPU build has no float16 ``index_select``: a float16 cache works on a GPU only.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import paddle

KVDtype = Literal["float32", "float16", "bfloat16"]
"""Element types a KV pool may hold (paddle's names for them)."""

HOST_DTYPES: dict[str, type[np.generic]] = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
"""The numpy type a pool's elements travel as: bfloat16 as its raw 2-byte bits."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("need at least 2 blocks (block 0 is scratch)")
        self.total = num_blocks - 1
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    def __init__(
        self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: KVDtype = "float32"
    ) -> None:
        self.layers, self.block_size = layers, block_size
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        shape = [num_blocks * block_size, kv_heads, head_dim]
        self.k = [paddle.zeros(shape, dtype) for _ in range(layers)]
        self.v = [paddle.zeros(shape, dtype) for _ in range(layers)]
        self.allocator = BlockAllocator(num_blocks)

    def slots(self, table: list[int], start: int, end: int) -> np.ndarray:
        """Slot ids of positions [start, end) of a request with this block table."""
        positions = np.arange(start, end)
        blocks = np.asarray(table, dtype=np.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> None:
        # In place: non-inplace scatter copies the whole pool, fancy assignment is 10-100x slower.
        if self.dtype == "float32":
            paddle.scatter_(self.k[layer], slots, k, overwrite=True)
            paddle.scatter_(self.v[layer], slots, v, overwrite=True)
        else:  # no 16-bit scatter kernel on the CPU
            paddle.index_put_(self.k[layer], (slots,), k)
            paddle.index_put_(self.v[layer], (slots,), v)

    def gather(self, layer: int, slots: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        return paddle.index_select(self.k[layer], slots, axis=0), paddle.index_select(self.v[layer], slots, axis=0)

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * np.dtype(HOST_DTYPES[self.dtype]).itemsize

    def export(self, table: list[int], length: int) -> bytes:
        """Positions [0, length) of a request, every layer's K then V, as one byte string: one
        gather per pool and one concat on the device, then one copy to the host."""
        slots = paddle.to_tensor(self.slots(table, 0, length))
        pools = (pool for layer in range(self.layers) for pool in (self.k[layer], self.v[layer]))
        parts = [paddle.index_select(pool, slots, axis=0) for pool in pools]
        return paddle.concat(parts, axis=0).numpy().tobytes()

    def import_(self, table: list[int], length: int, payload: bytes, start: int = 0) -> None:
        """Write an exported request into this cache under another block table: positions
        [``start``, ``length``) of it (those before ``start`` are in blocks it shares)."""
        expected = length * self.bytes_per_token()
        if len(payload) != expected:
            raise ValueError(f"KV payload has {len(payload)} bytes, expected {expected} for {length} tokens")
        if start >= length:
            return
        rows = np.frombuffer(payload, HOST_DTYPES[self.dtype]).reshape(
            self.layers, 2, length, self.kv_heads, self.head_dim
        )
        # One copy to the device of every position to write, [layers x 2 x tokens, heads, dim]; the
        # layers' K and V are row ranges of it (``_rows``).
        n = length - start
        rows = np.ascontiguousarray(rows[:, :, start:]).reshape(-1, self.kv_heads, self.head_dim)
        on_device = paddle.to_tensor(rows, dtype=self.dtype)
        slots = paddle.to_tensor(self.slots(table, start, length))
        for layer in range(self.layers):
            k, v = (_rows(on_device, i * n, (i + 1) * n) for i in (2 * layer, 2 * layer + 1))
            self.write(layer, slots, k, v)


def _view_of_rows(tensor: paddle.Tensor, start: int, end: int) -> paddle.Tensor:
    """Rows [start, end) of ``tensor`` as a view: ``Tensor._slice``, private to Paddle (3.3.1 has
    it). Indexing, or ``paddle.slice``, copies them when FLAGS_use_stride_kernel=0: importing 2048
    tokens of SmolLM2's shape on the CPU (one core, medians of 15) took 31 ms from views against
    41 ms from copies (of which the 60 writes, 18 ms against 25 ms)."""
    return tensor._slice(start, end)


def _copy_of_rows(tensor: paddle.Tensor, start: int, end: int) -> paddle.Tensor:
    """Rows [start, end) of ``tensor``, copied: for a Paddle without ``Tensor._slice``."""
    return paddle.slice(tensor, [0], [start], [end])


_rows = _view_of_rows if hasattr(paddle.Tensor, "_slice") else _copy_of_rows
"""How ``import_`` takes a layer's K or V out of the one tensor it uploads."""
