"""The logits processors and min-p, each against a plain loop over the vocabulary that follows
the parameter's definition (OpenAI's, HF's and vLLM's), not the vectorized code under test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from splitbus.bus.messages import SamplingParams
from splitbus.gpu_ops.logits import process
from splitbus.gpu_ops.sampling import sample

VOCAB = 64
EOS = (63,)
PROMPT = [3, 5, 5, 9, 40]
OUTPUT = [5, 7, 7, 7, 12, 40, 2]


def _logits(seed: int = 0) -> np.ndarray:
    # Both signs, so the repetition penalty's two branches are taken.
    return np.random.default_rng(seed).normal(0.0, 3.0, VOCAB).astype(np.float32)


def _reference(logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM's order: min_tokens, logit_bias, repetition, then frequency and presence."""
    row = [float(x) for x in logits]
    if len(output) < params.min_tokens:
        for token in [*EOS, *params.stop_token_ids]:
            row[token] = -math.inf
    for key, bias in params.logit_bias.items():
        row[int(key)] += bias
    for token in set(prompt) | set(output):
        penalty = params.repetition_penalty
        row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


CASES = {
    "logit_bias": {"logit_bias": {"7": -100.0, "0": 2.5, "40": 100.0}},
    "min_tokens": {"min_tokens": 10, "stop_token_ids": [1, 2]},
    "repetition": {"repetition_penalty": 1.3},
    "repetition below 1": {"repetition_penalty": 0.6},
    "frequency": {"frequency_penalty": 0.7},
    "presence": {"presence_penalty": -1.5},
    "all": {
        "logit_bias": {"5": 3.0, "11": -4.0},
        "min_tokens": 8,
        "stop_token_ids": [9],
        "repetition_penalty": 1.7,
        "frequency_penalty": 0.4,
        "presence_penalty": 0.9,
    },
}


@pytest.mark.parametrize("name", CASES)
def test_each_processor_matches_its_definition(name: str) -> None:
    params = SamplingParams(max_tokens=16, **CASES[name])  # type: ignore[arg-type]  # the fields vary per case
    logits = _logits(len(name))
    processed = process(logits, params, PROMPT, OUTPUT, EOS)
    np.testing.assert_allclose(processed, _reference(logits, params, PROMPT, OUTPUT), rtol=1e-12)
    assert not np.array_equal(processed, logits)  # the case changes something
    np.testing.assert_array_equal(logits, _logits(len(name)))  # the raw row is left for logprobs


def test_a_request_without_processors_gets_its_row_itself() -> None:
    logits = _logits()
    assert process(logits, SamplingParams(), PROMPT, OUTPUT, EOS) is logits
    reached = SamplingParams(max_tokens=16, min_tokens=len(OUTPUT), stop_token_ids=[1])
    assert process(logits, reached, PROMPT, OUTPUT, EOS) is logits  # min_tokens reached: nothing held off


def test_min_tokens_holds_off_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(max_tokens=16, min_tokens=3, stop_token_ids=[4])
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[EOS[0]], logits[4] = 50.0, 40.0  # what greedy would pick, in this order
    held = [int(np.argmax(process(logits, params, PROMPT, OUTPUT[:n], EOS))) for n in range(5)]
    assert held[:3] == [0, 0, 0] and held[3:] == [EOS[0], EOS[0]]


def test_ids_past_the_row_are_skipped() -> None:
    # The bus bounds ids to int32, not to a vocabulary; the API refuses these, a worker survives them.
    params = SamplingParams(
        max_tokens=4, logit_bias={str(VOCAB + 5): 10.0, "1": 1.0}, min_tokens=2, stop_token_ids=[999]
    )
    logits = _logits()
    processed = process(logits, params, PROMPT, [], (VOCAB,))
    expected = logits.astype(np.float64)
    expected[1] += 1.0
    np.testing.assert_array_equal(processed, expected)


def test_a_row_of_stop_tokens_only_is_not_emptied() -> None:
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(VOCAB - 1)))
    logits = _logits()
    processed = process(logits, params, PROMPT, [], EOS)
    assert np.isfinite(processed).all()
    assert sample(processed, 1.0, 0, 1.0, seed=1, step=0) in range(VOCAB)


@pytest.mark.parametrize("temperature, top_k, min_p", [(1.0, 0, 0.1), (0.7, 0, 0.02), (1.5, 10, 0.3)])
def test_min_p_draws_as_if_the_unlikely_tokens_were_masked(temperature: float, top_k: int, min_p: float) -> None:
    """vLLM's min-p: after temperature, a token is kept when its probability is at least min_p
    times the largest; masking the others by hand and sampling without min-p draws the same."""
    logits = _logits(7)
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    probs /= probs.sum()
    kept = probs >= min_p * probs.max()
    masked = np.where(kept, logits, -np.inf)
    draws = [sample(logits, temperature, top_k, 1.0, 5, step, min_p=min_p) for step in range(300)]
    assert draws == [sample(masked, temperature, top_k, 1.0, 5, step) for step in range(300)]
    assert set(draws) <= set(np.flatnonzero(kept).tolist()) and len(set(draws)) > 1


def test_min_p_zero_and_greedy_leave_sampling_as_it_was() -> None:
    logits = _logits(3)
    assert [sample(logits, 1.0, 0, 0.9, 2, s) for s in range(50)] == [
        sample(logits, 1.0, 0, 0.9, 2, s, min_p=0.0) for s in range(50)
    ]
    assert sample(logits, 0.0, 0, 1.0, 2, 0, min_p=0.99) == int(np.argmax(logits))
