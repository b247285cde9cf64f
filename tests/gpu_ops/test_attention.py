"""Batched attention against the one-sequence reference (``attention``), over random batches."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from splitbus.gpu_ops import attention as attention_module
from splitbus.gpu_ops.attention import Run, attention, batched_attention, plan
from splitbus.gpu_ops.layers import RopeTables, rope_tables

HEADS, KV_HEADS, DIM, SLOTS = 6, 2, 16, 4096


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


def test_a_decode_batch_is_one_group_and_long_and_short_prompts_are_not() -> None:
    rng = np.random.default_rng(7)
    decodes, q, _ = _batch(rng, [(int(n), 1) for n in rng.integers(1, 300, 32)])
    assert len(plan(decodes, HEADS, 0, len(q)).groups) == 1
    mixed, q, _ = _batch(rng, [(0, 500), (0, 12), (0, 9), (3, 1)])
    groups = plan(mixed, HEADS, 0, len(q)).groups
    assert sorted(g.queries for g in groups) == [1, 12, 500]  # 9 rides with 12; 500 pads nobody


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
    groups = plan(runs, HEADS, 0, len(q)).groups
    tiled = [g for g in groups if g.tile < g.queries]
    assert tiled and all(g.mask is None for g in tiled)  # no whole-prompt mask either
    assert all(g.count * HEADS * g.tile * g.keys <= max(budget, g.count * HEADS * 16 * g.keys) for g in tiled)
    np.testing.assert_allclose(_batched(runs, q, pool), expected, atol=2e-5)


def test_padding_reads_only_the_pad_slot_and_changes_nothing() -> None:
    """Whatever the pad slot holds (here: huge values), no real query's output moves."""
    rng = np.random.default_rng(11)
    runs, q, pool = _batch(rng, [(0, 5), (20, 1), (3, 2)])
    expected = _batched(runs, q, pool)
    pool[:, 0] = 1e4
    np.testing.assert_allclose(_batched(runs, q, pool), expected, atol=0)


def test_rope_tables_on_the_device_match_the_host_tables_and_grow() -> None:
    tables = RopeTables(8, 10000.0, length=16)
    positions = np.array([0, 3, 15, 40, 7])  # 40: past the tables made at load
    cos, sin = tables.at(paddle.to_tensor(positions), int(positions.max()))
    want_cos, want_sin = rope_tables(positions, 8, 10000.0)
    assert tables.cos.shape[0] > 40
    np.testing.assert_array_equal(cos.numpy(), want_cos.numpy())
    np.testing.assert_array_equal(sin.numpy(), want_sin.numpy())
