"""Logprobs through `splitbus up` (paddle engine, tiny model, P -> D) with the openai client, each
checked against an independent computation: the log softmax, in float64 numpy, of the logits of
the engine's full-recompute forward (no KV cache) over each prefix of the sequence."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from splitbus.gpu_ops import device

device.prepare()

from splitbus.worker.engines.paddle.model import CausalLM, Chunk, load_model  # noqa: E402
from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from tests.e2e.conftest import System, start_system, stop_system  # noqa: E402

TOLERANCE = 2e-4
"""The paged, batched forward and the full recompute sum in other orders: float32 rounding."""
PROMPT = [5, 77, 130, 9, 250, 31, 64, 200, 18, 99, 3, 141]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("paddle") / "tiny", "llama", seed=5)


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("up"), "--engine", "paddle", "--model", str(model_dir))
    yield running
    assert stop_system(running) == []


@pytest.fixture(scope="module")
def model(model_dir: Path) -> CausalLM:
    return load_model(model_dir)


@pytest.fixture()
def client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)


def log_softmax(model: CausalLM, tokens: list[int]) -> np.ndarray:
    """The distribution of the token after ``tokens``, recomputed whole."""
    logits = model.forward([Chunk(tokens, 0)])[0].astype(np.float64)
    shifted = logits - logits.max()
    return shifted - math.log(np.exp(shifted).sum())


def test_completion_logprobs_are_the_models_log_softmax(client: openai.OpenAI, model: CausalLM) -> None:
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert len(logprobs.tokens) == reply.usage.completion_tokens == 6  # type: ignore[union-attr]
    generated: list[int] = []
    for token_logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        expected = log_softmax(model, PROMPT + generated)
        best = int(np.argmax(expected))
        generated.append(best)
        assert token_logprob == pytest.approx(expected[best], abs=TOLERANCE)
        assert max(top.values()) == token_logprob  # greedy: its own is the top one, bit for bit
        assert sorted(top.values(), reverse=True) == pytest.approx(sorted(expected, reverse=True)[:3], abs=TOLERANCE)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_echo_scores_the_prompt_as_an_eval_harness_asks(client: openai.OpenAI, model: CausalLM) -> None:
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1."""
    reply = client.completions.create(model="tiny", prompt=[PROMPT], max_tokens=1, temperature=0, logprobs=1, echo=True)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == len(PROMPT) + 1  # the prompt's, then the generated token's
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        expected = log_softmax(model, PROMPT[:i])
        assert logprobs.token_logprobs[i] == pytest.approx(expected[PROMPT[i]], abs=TOLERANCE), i
        assert max(logprobs.top_logprobs[i].values()) == pytest.approx(expected.max(), abs=TOLERANCE)
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[:-1]  # type: ignore[union-attr]


def test_prompt_logprobs_are_recomputed_when_the_prefix_is_cached(client: openai.OpenAI, model: CausalLM) -> None:
    """vLLM's ``prompt_logprobs``: the second request finds the prompt's blocks cached, and still
    gets every position's logprob (its prefill skips the cache: docs/api.md)."""
    long = PROMPT * 4  # several full blocks
    replies = [
        client.completions.create(model="tiny", prompt=long, max_tokens=1, extra_body={"prompt_logprobs": 2})
        for _ in range(2)
    ]
    rows = [r.choices[0].model_extra["prompt_logprobs"] for r in replies]  # type: ignore[index]
    assert rows[0] == rows[1] and rows[0][0] is None and len(rows[0]) == len(long)
    expected = log_softmax(model, long[:7])
    assert rows[0][7][str(long[7])]["logprob"] == pytest.approx(expected[long[7]], abs=TOLERANCE)
    assert [v["rank"] for v in rows[0][7].values() if v["rank"] is not None][:2] == [1, 2]


def test_streamed_chat_logprobs_follow_each_token(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    items = [
        item
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content or []
    ]
    assert len(items) == 5
    for item in items:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob  # greedy
        assert item.bytes == list(item.token.encode()) or item.token.startswith("bytes:")
