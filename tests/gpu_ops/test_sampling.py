"""The batch sampler against the per-sequence reference (``sample``), the reference against its
definition, and ``log_softmax_top`` against the definition computed one value at a time with
``math`` (to a float32 logit's precision: the row less its largest logit stays float32)."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from splitbus.bus.messages import SamplingParams
from splitbus.gpu_ops import sampling
from splitbus.gpu_ops.sampling import (
    TOP_P_K,
    Draws,
    log_softmax_top,
    sample,
    sample_batch,
    sample_on_device,
    sample_on_host,
    uniform,
)

TEMPERATURES = (0.0, 0.0, 0.3, 1.0, 1.7)
TOP_KS = (0, 1, 3, 40, 10**6)
TOP_PS = (1.0, 1.0, 0.95, 0.5, 0.0)
MIN_PS = (0.0, 0.0, 0.05, 0.5)


def _params(rng: np.random.Generator) -> SamplingParams:
    return SamplingParams(
        max_tokens=1,
        temperature=float(rng.choice(TEMPERATURES)),
        top_k=int(rng.choice(TOP_KS)),
        top_p=float(rng.choice(TOP_PS)),
        min_p=float(rng.choice(MIN_PS)),
    )


def _logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Random rows with what a model's logits hold at times: ties (bf16 logits tie often), a
    row of two tied values, -inf where a grammar or ``min_tokens`` masked tokens."""
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    logits[0] = np.round(logits[0])  # many ties, at every cut
    logits[1, : vocab // 2], logits[1, vocab // 2 :] = 2.0, 1.0
    logits[2, rng.integers(0, vocab, vocab // 2)] = -np.inf
    return logits


def _reference(logits: np.ndarray, params: list[SamplingParams], seeds: list[int], steps: list[int]) -> list[int]:
    return [
        sample(row, p.temperature, p.top_k, p.top_p, seed, step, p.min_p)
        for row, p, seed, step in zip(logits, params, seeds, steps, strict=True)
    ]


@pytest.fixture(params=["device", "host"])
def where(request: pytest.FixtureRequest) -> str:
    """Which implementation ``_batch`` runs: Paddle ops (a GPU's, run here on the CPU) or numpy."""
    return str(request.param)


def _batch(
    where: str,
    logits: np.ndarray,
    params: list[SamplingParams],
    seeds: list[int],
    steps: list[int],
    replaced: dict[int, np.ndarray] | None = None,
) -> list[int]:
    draws = Draws.of(params, seeds, steps)
    if where == "host":
        return sample_on_host(logits, draws, replaced or {}).tolist()
    return sample_on_device(paddle.to_tensor(logits), draws, replaced or {}).tolist()


def test_logits_on_the_cpu_are_drawn_from_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sample_batch`` takes numpy's way for logits on the CPU (faster there), Paddle's on a GPU."""

    def on_device(*args: object) -> None:
        raise AssertionError("logits on the CPU drawn with Paddle's ops")

    monkeypatch.setattr(sampling, "sample_on_device", on_device)
    logits = np.random.default_rng(2).normal(0, 1, (3, 50)).astype(np.float32)
    draws = Draws.of([SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7)] * 3, [1, 2, 3], [0, 0, 0])
    assert sample_batch(paddle.to_tensor(logits), draws).tolist() == sample_on_host(logits, draws, {}).tolist()


@pytest.mark.parametrize("vocab", [7, 300, 5000])
def test_the_batch_draws_what_each_row_draws_alone(where: str, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    for _ in range(12):
        logits = _logits(rng, 16, vocab)
        params = [_params(rng) for _ in range(16)]
        seeds, steps = rng.integers(0, 2**40, 16).tolist(), rng.integers(0, 500, 16).tolist()
        assert _batch(where, logits, params, seeds, steps) == _reference(logits, params, seeds, steps)


def test_a_152k_vocabulary_row_draws_as_alone_with_and_without_top_p(where: str) -> None:
    """Qwen2.5's vocabulary; top-p over a flat row (the largest ``TOP_P_K`` fall short: the
    whole row is sorted) and over a peaked one (they reach it), in one batch."""
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (3, 151_936)).astype(np.float32)
    logits[1, :100] += 12.0  # peaked: its 100 largest hold nearly all the mass
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_p=p) for p in (1.0, 0.9, 0.9)]
    ordered = np.sort(np.exp(logits[2].astype(np.float64)))[::-1]
    assert ordered[:TOP_P_K].sum() < 0.9 * ordered.sum()  # the flat row takes the whole sort
    for step in range(5):
        seeds, steps = [11, 12, 13], [step] * 3
        assert _batch(where, logits, params, seeds, steps) == _reference(logits, params, seeds, steps)


def test_greedy_rows_are_the_argmax_bit_for_bit_ties_to_the_lowest_id(where: str) -> None:
    rng = np.random.default_rng(4)
    logits = np.round(rng.normal(0, 2, (32, 4096))).astype(np.float32)  # a dozen equal maxima a row
    logits[5] = -np.inf
    params = [SamplingParams(max_tokens=1, temperature=0.0)] * 32
    got = _batch(where, logits, params, list(range(32)), [0] * 32)
    assert got == np.argmax(logits, axis=1).tolist() and got[5] == 0


def test_rows_replaced_on_the_host_are_drawn_from_as_replaced(where: str) -> None:
    """A row processed on the host (penalties, a grammar's mask: float64) goes back into the
    batch; the draw reads it, not the logits the device holds."""
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 3, (4, 600)).astype(np.float32)
    processed = logits[1].astype(np.float64) - 0.5
    processed[::2] = -np.inf
    params = [SamplingParams(max_tokens=1, temperature=t, top_k=k) for t, k in ((1.0, 0), (0.8, 0), (0.0, 0), (1.0, 9))]
    got = _batch(where, logits, params, [1, 2, 3, 4], [7, 7, 7, 7], {1: processed, 2: -logits[2]})
    rows = [logits[0], processed, -logits[2], logits[3]]
    assert got == _reference(np.stack(rows), params, [1, 2, 3, 4], [7, 7, 7, 7]) and got[1] % 2 == 1


def test_the_draw_walks_the_kept_ids_in_id_order() -> None:
    """Weights 1, 3, 0 (-inf), 4, 0.5: top-k 3 keeps ids 0, 1 and 3 (total 8); the draw is the
    first id whose running sum (1, 4, 4, 8) exceeds u times the total."""
    logits = np.array([0.0, np.log(3.0), -np.inf, np.log(4.0), np.log(0.5)], dtype=np.float32)
    for step in range(40):
        u = uniform(9, step) * 8.0
        expected = 0 if u < 1.0 else 1 if u < 4.0 else 3
        assert sample(logits, 1.0, 3, 1.0, 9, step) == expected


def test_cuts_keep_the_lowest_ids_among_ties(where: str) -> None:
    """Top-k 2 of four equal logits keeps ids 0 and 1; top-p 0.5 of them needs two: 0 and 1."""
    ties = np.zeros(4, dtype=np.float32)
    assert {sample(ties, 1.0, 2, 1.0, 5, s) for s in range(60)} == {0, 1}
    assert {sample(ties, 1.0, 0, 0.5, 5, s) for s in range(60)} == {0, 1}
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_k=2), SamplingParams(max_tokens=1, top_p=0.5)]
    for step in range(20):
        assert _batch(where, np.stack([ties, ties]), params, [5, 5], [step] * 2) == _reference(
            np.stack([ties, ties]), params, [5, 5], [step] * 2
        )


def test_draws_follow_the_probabilities(where: str) -> None:
    """Over many steps each id comes up as often as its probability says (softmax at temperature 2)."""
    logits = np.array([0.0, 1.0, 2.0, -np.inf, 3.0], dtype=np.float32)
    params = [SamplingParams(max_tokens=1, temperature=2.0)] * 500
    tokens = np.array(_batch(where, np.tile(logits, (500, 1)), params, [77] * 500, list(range(500))))
    probs = np.exp(logits / 2.0) / np.exp(logits / 2.0).sum()
    assert np.abs(np.bincount(tokens, minlength=5) / 500 - probs).max() < 0.06 and 3 not in tokens


def test_a_row_with_nothing_to_draw_from_gets_its_raw_rows_argmax(where: str) -> None:
    """Rows whose largest logit is not finite, greedy or sampled, top-k and top-p or not, on
    both paths: masked whole on the host (``min_tokens`` holding back the only tokens a grammar
    allows), a NaN, all NaN, an overflow to +inf. Each gets the argmax of its raw row (NaN read
    as -inf); the control row draws as ``sample`` does."""
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 2, (6, 300)).astype(np.float32)
    logits[1, [17, 250]] = np.nan
    logits[2] = np.nan
    logits[3, [40, 90]] = np.inf
    masked = np.full(300, -np.inf)
    expected = [int(np.argmax(logits[0])), int(np.nanargmax(logits[1])), 0, 40, int(np.argmax(logits[4]))]
    for temperature, top_k, top_p in ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.5)):
        params = [SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)] * 6
        seeds, steps = list(range(6)), [3] * 6
        got = _batch(where, logits, params, seeds, steps, {0: masked, 4: masked})
        assert got[:5] == expected
        assert got[5] == _reference(logits[5:], params[5:], seeds[5:], steps[5:])[0]


def test_the_reference_gives_a_row_with_nothing_to_draw_from_its_argmax() -> None:
    row = np.array([1.0, np.nan, 3.0, np.nan], dtype=np.float32)
    assert [sample(row, t, 0, 1.0, 1, 0) for t in (0.0, 1.0)] == [2, 2]
    assert sample(np.full(9, -np.inf, dtype=np.float32), 1.0, 0, 0.9, 1, 0) == 0


def test_a_device_token_past_the_vocabulary_is_clamped_to_its_last_id() -> None:
    """The backstop behind the draw's own bound: a kernel whose search ran past the end."""
    logits = paddle.to_tensor(np.zeros((2, 50), dtype=np.float32))
    tokens = sampling._checked(lambda rows: paddle.full([rows.shape[0]], 50, dtype="int64"), logits, np.arange(2), {})
    assert tokens.numpy().tolist() == [49, 49]


def test_bf16_logits_draw_what_their_float32_values_draw() -> None:
    """A GPU's bf16 logits: Paddle's path (its CPU kernels have no bf16 argmax) and the host's
    (numpy has no bf16) read their values, not their bits."""
    rng = np.random.default_rng(10)
    bf16 = paddle.to_tensor(_logits(rng, 16, 300)).astype("bfloat16")
    exact = bf16.astype("float32").numpy()
    params = [_params(rng) for _ in range(16)]
    seeds, steps = list(range(16)), [2] * 16
    draws = Draws.of(params, seeds, steps)
    expected = _reference(exact, params, seeds, steps)
    assert sample_on_device(bf16, draws, {}).tolist() == expected
    assert sample_batch(bf16, draws).tolist() == expected  # on the CPU: the host's path


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
