"""Batched attention against the one-sequence reference (``attention``), over random batches."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from splitbus.gpu_ops import attention as attention_module
from splitbus.gpu_ops.attention import Run, attention, batched_attention, plan
from splitbus.gpu_ops.layers import RopeTables, rope_tables

HEADS, KV_HEADS, DIM, SLOTS = 6, 2, 16, 16384


def _batch(rng: np.random.Generator, shapes: list[tuple[int, int]]) -> tuple[list[Run], np.ndarray, np.ndarray]:
    """Runs of (start, queries) whose keys sit at random distinct slots of a pool; slot 0 is the
    pad slot and holds nothing of theirs. Returns the runs, and the packed queries and pool."""
    free = rng.permutation(np.arange(1, SLOTS))
    runs, first = [], 0
    for start, queries in shapes:
        runs.append(Run(first, start, queries, free[: start + queries]))
        free, first = free[start + queries :], first + queries
    q = rng.standard_normal((first, HEADS, DIM)).astype(np.float32)
    pool = rng.standard_normal((2, SLOTS, KV_HEADS, DIM)).astype(np.float32)
    return runs, q, pool


def _reference(runs: list[Run], q: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """Each run alone through ``attention``, its keys gathered from the pool, packed again."""
    outs = []
    for r in runs:
        k, v = (paddle.to_tensor(pool[i][r.key_rows]) for i in (0, 1))
        outs.append(attention(paddle.to_tensor(q[r.first_row : r.first_row + r.queries]), k, v, r.start).numpy())
    return np.concatenate(outs)


def _batched(runs: list[Run], q: np.ndarray, pool: np.ndarray) -> np.ndarray:
    layout = plan(runs, HEADS, key_pad=0, total=len(q))
    k, v = (paddle.to_tensor(pool[i]) for i in (0, 1))
    return batched_attention(paddle.to_tensor(q), k, v, layout).numpy()


@pytest.mark.parametrize("seed", range(6))
def test_a_random_batch_of_mixed_lengths_matches_each_sequence_alone(seed: int) -> None:
    """Prefills from position 0, prefills after a cached prefix, and decodes, in one batch."""
    rng = np.random.default_rng(seed)
    shapes = [(int(rng.integers(0, 3)) * int(rng.integers(0, 40)), int(rng.integers(1, 50))) for _ in range(7)]
    shapes += [(int(rng.integers(1, 90)), 1) for _ in range(5)]  # decodes
    rng.shuffle(shapes)
    runs, q, pool = _batch(rng, shapes)
    np.testing.assert_allclose(_batched(runs, q, pool), _reference(runs, q, pool), atol=2e-5)


def test_groups_pad_neither_queries_nor_keys_to_more_than_twice_a_runs_own() -> None:
    """A decode beside an 8000-token context, a long prompt beside short ones: each run is padded
    to less than twice its query count and key count."""
    rng = np.random.default_rng(7)
    shapes = [(int(n), 1) for n in rng.integers(1, 300, 31)] + [(3000, 1), (0, 500), (0, 12), (0, 9), (40, 3)]
    runs, q, _ = _batch(rng, shapes)
    layout = plan(runs, HEADS, 0, len(q))
    assert sum(g.count for g in layout.groups) == len(runs)
    for g in layout.groups:
        rows = g.key_rows.numpy().reshape(g.count, g.keys)
        members = [r for r in runs if any(np.array_equal(row[: len(r.key_rows)], r.key_rows) for row in rows)]
        assert len(members) == g.count
        assert all(g.keys < 2 * len(r.key_rows) and g.queries < 2 * r.queries for r in members)
    same, q, pool = _batch(rng, [(int(n), 1) for n in rng.integers(128, 255, 32)])
    layout = plan(same, HEADS, 0, len(q))
    assert len(layout.groups) == 1 and layout.in_order  # a decode batch of like contexts: one group, in order
    np.testing.assert_allclose(_batched(same, q, pool), _reference(same, q, pool), atol=2e-5)
    padded, q, pool = _batch(rng, [(0, 3), (0, 2)])  # one group, its rows in order, one run padded
    assert not plan(padded, HEADS, 0, len(q)).in_order
    np.testing.assert_allclose(_batched(padded, q, pool), _reference(padded, q, pool), atol=2e-5)


@pytest.mark.parametrize("budget", [1 << 12, 1 << 16])
def test_a_long_prompt_runs_in_tiles_of_queries_with_the_same_result(
    budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a small score budget the prompt (after a cached prefix, beside a short one) is split
    into tiles, each seeing only the keys its queries can; the output does not change."""
    rng = np.random.default_rng(budget)
    runs, q, pool = _batch(rng, [(37, 300), (0, 200), (5, 1)])
    expected = _reference(runs, q, pool)
    monkeypatch.setattr(attention_module, "SCORE_BUDGET", budget)
    tiled = [g for g in plan(runs, HEADS, 0, len(q)).groups if g.tile < g.queries]
    assert tiled and all(g.mask is None for g in tiled)  # no whole-prompt mask either
    seen: list[tuple[int, int]] = []  # (queries, keys) of each tile's mask
    made = attention_module._mask
    monkeypatch.setattr(
        attention_module, "_mask", lambda s, a, b, k, h, d: seen.append((b - a, k)) or made(s, a, b, k, h, d)
    )
    np.testing.assert_allclose(_batched(runs, q, pool), expected, atol=2e-5)
    # Each tile within the budget, or at the floor of MIN_TILE queries (a run's keys all needed).
    assert seen and all(
        HEADS * keys * queries <= budget or queries <= attention_module.MIN_TILE for queries, keys in seen
    )
    assert seen[0][1] < seen[-1][1]  # the first tile sees fewer keys than the last


def test_many_prompts_after_long_prefixes_are_cut_into_groups_within_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Even the smallest tile of 24 prompts after 300-token prefixes would pass a small budget:
    the group is cut by runs, and the result does not change."""
    rng = np.random.default_rng(13)
    runs, q, pool = _batch(rng, [(300, 20)] * 24)
    expected = _reference(runs, q, pool)
    monkeypatch.setattr(attention_module, "SCORE_BUDGET", 1 << 16)
    groups = plan(runs, HEADS, 0, len(q)).groups
    assert len(groups) > 1
    assert all(g.count * HEADS * min(g.tile, attention_module.MIN_TILE) * g.keys <= 1 << 16 for g in groups)
    np.testing.assert_allclose(_batched(runs, q, pool), expected, atol=2e-5)


def test_padding_reads_only_the_pad_slot_and_changes_nothing() -> None:
    """Whatever finite values of normal size the pad slot holds (the idle forward's K/V: here
    large ones), no real query's output moves."""
    rng = np.random.default_rng(11)
    runs, q, pool = _batch(rng, [(0, 5), (20, 1), (3, 2)])
    expected = _batched(runs, q, pool)
    pool[:, 0] = 50.0
    np.testing.assert_allclose(_batched(runs, q, pool), expected, atol=0)


def test_rope_tables_on_the_device_match_the_host_tables_and_grow() -> None:
    tables = RopeTables(8, 10000.0, length=16)
    positions = np.array([0, 3, 15, 40, 7])  # 40: past the tables made at load
    cos, sin = tables.at(paddle.to_tensor(positions), int(positions.max()))
    want_cos, want_sin = rope_tables(positions, 8, 10000.0)
    assert tables.cos.shape[0] > 40
    np.testing.assert_array_equal(cos.numpy(), want_cos.numpy())
    np.testing.assert_array_equal(sin.numpy(), want_sin.numpy())
