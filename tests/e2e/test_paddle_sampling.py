"""`splitbus up` with the paddle engine, P and D: the sampling parameters that act on the logits
hold through the hand-off, through the official openai client. P draws the first token, D the
rest from the prompt and the tokens so far; both must apply the same processors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from splitbus.gpu_ops import device

device.prepare()

from splitbus.bus.messages import SamplingParams  # noqa: E402
from splitbus.gpu_ops.logits import process  # noqa: E402
from splitbus.tokenization import ModelTokenizer  # noqa: E402
from splitbus.worker.engines.paddle.model import Chunk, load_model  # noqa: E402
from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from splitbus.worker.text import TextStream  # noqa: E402
from tests.e2e import greedy  # noqa: E402
from tests.e2e.conftest import System, start_system, stop_system  # noqa: E402

NEW = 10
(PROMPT,) = greedy.prompts(4, (12,))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("paddle") / "tiny", "llama", seed=3)


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    system: System = start_system(tmp_path_factory.mktemp("up"), "--engine", "paddle", "--model", str(model_dir))
    try:
        yield openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=120)
    finally:
        assert stop_system(system) == []


def _greedy_ids(model_dir: Path, sampling: SamplingParams, outputs_seen: bool = True) -> list[int]:
    """Greedy tokens by a full forward for each (no KV cache), processed as the request's
    parameters say; with ``outputs_seen`` false, as if the tokens so far were not known."""
    model, eos = load_model(model_dir), ModelTokenizer.load(model_dir).eos_token_ids
    tokens: list[int] = []
    while len(tokens) < sampling.max_tokens and (not tokens or tokens[-1] not in eos):
        row = model.forward([Chunk(PROMPT + tokens, 0)])[0]
        tokens.append(int(np.argmax(process(row, sampling, PROMPT, tokens if outputs_seen else [], eos))))
    return tokens


def _text(model_dir: Path, ids: list[int]) -> str:
    stream = TextStream(ModelTokenizer.load(model_dir), [])
    return "".join(stream.push([t]) for t in ids) + stream.flush()


@pytest.mark.parametrize(
    "options, vllm",
    [
        ({"presence_penalty": -2.0}, {}),  # a negative penalty: D repeats the token P drew
        ({}, {"repetition_penalty": 0.5}),
    ],
)
def test_bias_and_penalties_give_the_greedy_text_computed_here(
    client: openai.OpenAI, model_dir: Path, options: dict[str, float], vllm: dict[str, float]
) -> None:
    plain = _greedy_ids(model_dir, SamplingParams(max_tokens=NEW, temperature=0.0))
    bias = {str(plain[0]): -100.0}  # the first greedy token, drawn by P, banned
    sampling = SamplingParams(max_tokens=NEW, temperature=0.0, logit_bias=bias, **options, **vllm)
    expected = _greedy_ids(model_dir, sampling)
    assert expected[0] != plain[0] and expected != _greedy_ids(model_dir, sampling, outputs_seen=False)
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, logit_bias=bias, **options, extra_body=vllm
    )
    assert reply.choices[0].text == _text(model_dir, expected) != _text(model_dir, plain)


def test_stop_token_ids_end_the_request_on_d(client: openai.OpenAI, model_dir: Path) -> None:
    plain = _greedy_ids(model_dir, SamplingParams(max_tokens=NEW, temperature=0.0))
    stop = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body={"stop_token_ids": [plain[4]]}
    )
    assert stop.choices[0].finish_reason == "stop" and stop.usage is not None
    assert stop.usage.completion_tokens == plain.index(plain[4]) + 1  # the stop token counts, unprinted
    assert stop.choices[0].text == _text(model_dir, plain[: plain.index(plain[4])])


def test_min_tokens_holds_off_eos_on_p_and_on_d(client: openai.OpenAI, model_dir: Path) -> None:
    eos = ModelTokenizer.load(model_dir).eos_token_ids[0]
    forced = {str(eos): 100.0}  # EOS is the greedy token whenever it may be drawn
    at_once = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, logit_bias=forced)
    assert at_once.choices[0].text == "" and at_once.choices[0].finish_reason == "stop"
    assert at_once.usage is not None and at_once.usage.completion_tokens == 1  # P drew EOS
    for min_tokens in (1, 4):
        held = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=NEW, logit_bias=forced, extra_body={"min_tokens": min_tokens}
        )
        assert held.choices[0].finish_reason == "stop" and held.usage is not None
        assert held.usage.completion_tokens == min_tokens + 1  # D drew EOS right after min_tokens
