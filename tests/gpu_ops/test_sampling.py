"""``log_softmax_top`` against the definition, computed one value at a time with ``math``: to a
float32 logit's precision (the row less its largest logit stays float32)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from splitbus.gpu_ops.sampling import log_softmax_top


def _by_definition(row: list[float]) -> list[float]:
    total = sum(math.exp(x) for x in row)
    return [math.log(math.exp(x) / total) for x in row]


def test_each_rows_target_and_top_k_are_its_log_softmax() -> None:
    rows = np.random.default_rng(7).normal(0, 3, size=(4, 50)).astype(np.float32)
    targets = np.array([0, 17, 49, 3])
    chosen, ids, values = log_softmax_top(rows, targets, 5)
    for row, target, got, top_ids, top in zip(rows.tolist(), targets, chosen, ids, values, strict=True):
        expected = _by_definition(row)
        assert got == pytest.approx(expected[target], abs=1e-6)
        best = sorted(range(50), key=lambda i: (-expected[i], i))[:5]
        assert top_ids.tolist() == best and top == pytest.approx([expected[i] for i in best], abs=1e-6)
        assert got in top or target not in best  # a token's value and its top value are the same, bit for bit


def test_ties_go_to_the_lowest_id_and_k_past_the_vocabulary_is_the_whole_row() -> None:
    rows = np.array([[1.0, 3.0, 3.0, 0.0]], dtype=np.float32)
    _, ids, values = log_softmax_top(rows, np.array([2]), 9)
    assert ids.tolist() == [[1, 2, 0, 3]] and values[0][0] == values[0][1]
    chosen, ids, values = log_softmax_top(rows, np.array([2]), 0)
    assert (
        ids.shape == (1, 0) and values.shape == (1, 0) and chosen[0] == pytest.approx(_by_definition([1, 3, 3, 0])[2])
    )


def test_a_large_vocabulary_keeps_the_small_probabilities() -> None:
    """float64: over 150k logits a float32 sum would lose the tail's digits."""
    row = np.zeros((1, 151_936), dtype=np.float32)
    row[0, 0] = 30.0
    chosen, _, _ = log_softmax_top(row, np.array([5]), 1)
    assert chosen[0] == pytest.approx(-30.0 - math.log1p(151_935 * math.exp(-30.0)), abs=1e-9)


def test_ties_at_the_kth_place_go_to_the_lowest_ids_as_argmax_picks() -> None:
    row = np.zeros((1, 300), dtype=np.float32)
    row[0, 100:200] = 5.0  # a hundred equal maxima, as bf16 logits often hold
    _, ids, _ = log_softmax_top(row, np.array([0]), 3)
    assert ids.tolist() == [[100, 101, 102]] and ids[0][0] == int(np.argmax(row[0]))
