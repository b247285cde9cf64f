"""Attention, grouped-query without repeating K/V, with an explicit mask aligned bottom-right.

Queries sit at absolute positions ``start .. start + S - 1`` and keys at ``0 .. L - 1``; query i
sees key j when ``j <= start + i``. Aligned bottom-right, the mask is right when queries are fewer
than keys (decode, chunked prefill, prefix reuse), unlike a top-left ``is_causal``.

``batched_attention`` is what the model runs: every chunk of a step in one gather of its keys and
one batched matmul pair per layer and group, the chunks of a group padded to a common query and
key length. Its ``Plan`` holds the step's row indices and masks as device tensors, built once per
step from the chunks' shapes and used by every layer. Chunks share a group when their query counts
lie within one power of two and their key counts do (``_groups``), so padding at most doubles
either; a group whose score matrix would pass ``SCORE_BUDGET`` elements runs in tiles of queries,
so a long prompt never makes its whole-prompt score matrix. ``attention`` is the one-sequence reference
the tests compare it with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from splitbus.gpu_ops.kv_cache import KVDtype

SCORE_BUDGET = 1 << 23
"""Score elements (32 MiB in float32) one batched matmul may make; a group past it runs in tiles of
queries. The whole-prompt matrix of a 4096-token prompt over SmolLM2's 9 heads is 151 M."""
MIN_TILE = 16
"""The fewest queries a tile holds."""


def causal_mask(queries: int, keys: int, q_offset: int) -> np.ndarray:
    rows = np.arange(queries)[:, None] + q_offset
    return np.where(np.arange(keys)[None, :] <= rows, 0.0, -np.inf).astype(np.float32)


def attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, q_offset: int) -> paddle.Tensor:
    """One sequence: q ``[S, H, D]``, k and v ``[L, Hkv, D]`` -> ``[S, H * D]``."""
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


@dataclass(frozen=True)
class Run:
    """One chunk's part in a step: its queries' rows in the packed tensor, their positions, and
    the rows of the key source it attends to (its key at position p is ``key_rows[p]``)."""

    first_row: int
    """The packed row of its first query."""
    start: int
    """The position of its first query; earlier positions are keys only."""
    queries: int
    key_rows: np.ndarray
    """``[start + queries]`` rows of the key source, by position."""


@dataclass(frozen=True)
class Group:
    """Chunks attended together, padded to the longest query run and key run; device tensors."""

    count: int
    queries: int
    keys: int
    q_rows: paddle.Tensor
    """``[count * queries]`` rows of the packed queries; padding reads the zero row appended."""
    key_rows: paddle.Tensor
    """``[count * keys]`` rows of the key source; padding reads its pad row."""
    sees: paddle.Tensor
    """``[count, 1, queries, 1]``: the last key position each query sees (its own)."""
    mask: paddle.Tensor | None
    """``[count, heads, queries, keys]`` additive mask, made once per step when it fits the budget;
    None: each tile makes its own from ``sees``. Made in the scores' own shape: Paddle's CPU add
    that broadcasts it over the heads took 16 ms for one 512-token prompt's layer, against 1.7 ms
    to expand it and add."""
    tile: int
    """Queries per matmul: ``queries`` when the group fits ``SCORE_BUDGET``."""
    last_start: int
    """The latest first position of its runs: a tile's queries see no key past it plus the tile's end."""
    dtype: KVDtype
    """The scores' dtype, which its masks are made in."""


@dataclass(frozen=True)
class Packed:
    """The step's runs unpadded, as FlashAttention's varlen kernel reads them; device tensors."""

    key_rows: paddle.Tensor
    """Every run's key rows, one run after another."""
    cu_queries: paddle.Tensor
    """``[runs + 1]`` int32: where each run's queries start in the packed queries, and the total."""
    cu_keys: paddle.Tensor
    """``[runs + 1]`` int32: where each run's keys start in ``key_rows``, and the total."""
    max_queries: int
    max_keys: int
    causal: bool
    """Whether the kernel masks causally: its mask is aligned top-left (Paddle's FlashAttention
    fork), right only when every run starts its sequence; a layout of one query per run (a decode
    step) sees every key of its run, with no mask. Other steps get no unpadded layout."""


@dataclass(frozen=True)
class Plan:
    """A step's attention layout, built once per step and read by every layer."""

    groups: list[Group]
    out_rows: paddle.Tensor
    """``[T]``: rows of the groups' padded outputs, concatenated, in packed order."""
    q_pad: int
    """The packed queries' row count T: the zero row appended at T pads query runs."""
    key_pad: int
    """The key source's row that pads key runs (a scratch slot, or the zero row appended)."""
    packed: Packed | None = None
    """The unpadded layout, made when the attention kernel reads it (``Kernels.unpadded``)."""
    in_order: bool = False
    """One group whose rows are the packed queries themselves, unpadded and in order (a decode
    step of like contexts): nothing to gather before or put back after."""


def plan(
    runs: Sequence[Run], heads: int, key_pad: int, total: int, unpadded: bool = False, dtype: KVDtype = "float32"
) -> Plan:
    """The step's groups and the permutation back to packed order; with ``unpadded``, the
    unpadded layout (``Packed``) a varlen kernel reads instead, when its causal mask is right for
    these runs. ``dtype``: the scores' (the masks are made in it)."""
    if unpadded and (all(r.start == 0 for r in runs) or all(r.queries == 1 for r in runs)):
        return Plan([], paddle.zeros([0], "int64"), total, key_pad, _packed(runs))
    groups, out_rows, offset = [], np.zeros(total, dtype=np.int64), 0
    for members in _groups(runs, heads):
        group = _group([runs[i] for i in members], heads, key_pad, total, dtype)
        for slot, i in enumerate(members):
            run = runs[i]
            padded = offset + slot * group.queries + np.arange(run.queries)
            out_rows[run.first_row : run.first_row + run.queries] = padded
        groups.append(group)
        offset += group.count * group.queries
    return Plan(groups, paddle.to_tensor(out_rows), total, key_pad, in_order=_in_order(groups, out_rows))


def _in_order(groups: list[Group], out_rows: np.ndarray) -> bool:
    """Whether the one group's rows are the packed queries themselves: none padded, none moved."""
    total = len(out_rows)
    unpadded = len(groups) == 1 and groups[0].count * groups[0].queries == total
    return unpadded and bool(np.array_equal(out_rows, np.arange(total)))


def _packed(runs: Sequence[Run]) -> Packed:
    if [r.first_row for r in runs] != [0, *np.cumsum([r.queries for r in runs[:-1]]).tolist()]:
        raise ValueError("the unpadded layout needs the runs in the packed queries' order")
    keys = [len(r.key_rows) for r in runs]
    return Packed(
        paddle.to_tensor(np.concatenate([r.key_rows for r in runs]).astype(np.int64)),
        paddle.to_tensor(np.concatenate([[0], np.cumsum([r.queries for r in runs])]).astype(np.int32)),
        paddle.to_tensor(np.concatenate([[0], np.cumsum(keys)]).astype(np.int32)),
        max(r.queries for r in runs),
        max(keys),
        causal=any(r.queries > 1 for r in runs),
    )


def _groups(runs: Sequence[Run], heads: int) -> list[list[int]]:
    """Runs whose query counts lie within one power of two, and whose key counts do, share a
    group: padding at most doubles either (a decode beside an 8000-token context pads to 20, not to
    8000). A group whose smallest tile would still pass ``SCORE_BUDGET`` is cut by runs."""
    sizes: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(runs):
        sizes.setdefault((r.queries.bit_length(), len(r.key_rows).bit_length()), []).append(i)
    parts = []
    for members in sizes.values():
        queries = max(runs[i].queries for i in members)
        keys = max(len(runs[i].key_rows) for i in members)
        per = max(1, SCORE_BUDGET // (heads * min(queries, MIN_TILE) * keys))
        parts += [members[j : j + per] for j in range(0, len(members), per)]
    return parts


def _group(runs: list[Run], heads: int, key_pad: int, q_pad: int, dtype: KVDtype) -> Group:
    queries = max(r.queries for r in runs)
    keys = max(len(r.key_rows) for r in runs)
    q_rows = np.full((len(runs), queries), q_pad, dtype=np.int64)
    key_rows = np.full((len(runs), keys), key_pad, dtype=np.int64)
    sees = np.zeros((len(runs), queries), dtype=np.int64)
    for i, r in enumerate(runs):
        q_rows[i, : r.queries] = np.arange(r.first_row, r.first_row + r.queries)
        key_rows[i, : len(r.key_rows)] = r.key_rows
        # A padded query sees as far as the run's last: a row of finite scores, thrown away.
        sees[i] = r.start + np.minimum(np.arange(queries), r.queries - 1)
    tile = _tile(len(runs) * heads * keys, queries)
    sees_t = paddle.to_tensor(sees.reshape(len(runs), 1, queries, 1))
    mask = _mask(sees_t, 0, queries, keys, heads, dtype) if tile == queries else None
    return Group(len(runs), queries, keys, paddle.to_tensor(q_rows.ravel()), paddle.to_tensor(key_rows.ravel()),
                 sees_t, mask, tile, max(r.start for r in runs), dtype)  # fmt: skip


def _tile(per_query: int, queries: int) -> int:
    """Queries per matmul so that one makes at most ``SCORE_BUDGET`` scores (a power of two, at
    least ``MIN_TILE``: ``_groups`` cuts a group whose ``MIN_TILE`` would pass the budget)."""
    if per_query * queries <= SCORE_BUDGET:
        return queries
    return max(MIN_TILE, 1 << int(math.log2(max(1, SCORE_BUDGET // per_query))))


def _mask(sees: paddle.Tensor, first: int, last: int, keys: int, heads: int, dtype: KVDtype) -> paddle.Tensor:
    """The additive mask ``[count, heads, last - first, keys]`` of queries [first, last), in
    ``dtype``: 0 where seen, -inf beyond."""
    positions = paddle.arange(keys, dtype="int64").reshape([1, 1, 1, keys])
    seen = positions <= sees[:, :, first:last, :]
    mask = paddle.where(seen, paddle.zeros([1], dtype), paddle.full([1], -math.inf, dtype))
    return mask.expand([sees.shape[0], heads, last - first, keys])


def batched_attention(
    q: paddle.Tensor, k_source: paddle.Tensor, v_source: paddle.Tensor, layout: Plan
) -> paddle.Tensor:
    """q ``[T, H, D]`` (every chunk's queries, packed), the key and value sources ``[M, Hkv, D]``
    (the cache's pools, or the step's own keys) -> ``[T, H * D]``."""
    if layout.in_order:
        return _attend_group(q, k_source, v_source, layout.groups[0], gather=False)
    q = paddle.concat([q, paddle.zeros([1, *q.shape[1:]], q.dtype)])
    outs = [_attend_group(q, k_source, v_source, g) for g in layout.groups]
    out = paddle.concat(outs) if len(outs) > 1 else outs[0]
    return paddle.index_select(out, layout.out_rows, axis=0)


def _attend_group(
    q: paddle.Tensor, k_source: paddle.Tensor, v_source: paddle.Tensor, g: Group, gather: bool = True
) -> paddle.Tensor:
    """One group's padded output ``[count * queries, H * D]``; ``gather`` False: ``q`` is already
    its rows (``Plan.in_order``)."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_source.shape[1]
    per = heads // kv_heads
    # [n, S, Hkv, G, D] -> [n, Hkv, G, S, D]; keys [n, L, Hkv, D] -> [n, Hkv, L, D]: each KV head
    # serves its G query heads, K and V never repeated.
    rows = paddle.index_select(q, g.q_rows, axis=0) if gather else q
    qh = rows.reshape([g.count, g.queries, kv_heads, per, dim])
    qh = qh.transpose([0, 2, 3, 1, 4]) * (dim**-0.5)
    k, v = (
        paddle.index_select(s, g.key_rows, axis=0).reshape([g.count, g.keys, kv_heads, dim]).transpose([0, 2, 1, 3])
        for s in (k_source, v_source)
    )
    tiles = [_attend_tile(qh, k, v, g, first) for first in range(0, g.queries, g.tile)]
    out = paddle.concat(tiles, axis=3) if len(tiles) > 1 else tiles[0]  # [n, Hkv, G, S, D]
    return out.transpose([0, 3, 1, 2, 4]).reshape([g.count * g.queries, heads * dim])


def _attend_tile(qh: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, g: Group, first: int) -> paddle.Tensor:
    """Queries [first, first + tile) of a group against the keys the last of them can see."""
    last = min(first + g.tile, g.queries)
    n, kv_heads, per, _, dim = qh.shape
    if g.mask is not None:  # the whole group at once
        q, keys, mask = qh, g.keys, g.mask
    else:
        keys = min(g.keys, g.last_start + last)
        q, k, v = qh[:, :, :, first:last, :], k[:, :, :keys, :], v[:, :, :keys, :]
        mask = _mask(g.sees, first, last, keys, kv_heads * per, g.dtype)
    scores = paddle.matmul(q.reshape([n, kv_heads, per * (last - first), dim]), k, transpose_y=True)
    scores = scores.reshape([n, kv_heads * per, last - first, keys])
    probs = F.softmax(scores + mask, axis=-1)
    out = paddle.matmul(probs.reshape([n, kv_heads, per * (last - first), keys]), v)
    return out.reshape([n, kv_heads, per, last - first, dim])
