"""lm-evaluation-harness (`lm-eval`) runs unchanged against `splitbus up` (paddle engine, tiny
model), as a user runs it: its CLI, offline, on the small tasks of tests/lm_eval/tasks/.

- `local-completions` scores the multiple-choice task by loglikelihood: `echo` + `logprobs` on
  the prompt's token ids, split into context and continuation by the server's `/tokenize` (lm-eval's
  `remote` tokenizer backend, which it picks itself: no transformers needed).
- `local-chat-completions` answers the generation task (`generate_until`, chat template applied
  by the server).

Every score lm-eval reports is checked against the tiny model run here: each continuation's
log-softmax sum and greediness by a full recompute (no KV cache), the accuracy that follows from
them, and each generated text by greedy decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitbus.gpu_ops import device

device.prepare()

from splitbus.tokenization import ModelTokenizer  # noqa: E402
from splitbus.worker.engines.paddle.model import CausalLM, Chunk, load_model  # noqa: E402
from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from splitbus.worker.text import TextStream  # noqa: E402
from tests.e2e.conftest import System, start_system, stop_system  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "lm_eval" / "tasks"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""Hugging Face datasets and hub stay off the network: the tasks' data files are in the checkout."""
MAX_GEN_TOKS, UNTIL = 8, "\n"
"""splitbus_gen.yaml's generation_kwargs."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("paddle") / "tiny", "llama", seed=3)


@pytest.fixture(scope="module")
def system(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("up"), "--engine", "paddle", "--model", str(model_dir))
    yield running
    assert stop_system(running) == []


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[CausalLM, ModelTokenizer]:
    return load_model(model_dir), ModelTokenizer.load(model_dir)


@pytest.mark.timeout(300)
def test_local_completions_loglikelihoods_equal_the_model_s(
    system: System, reference: tuple[CausalLM, ModelTokenizer], tmp_path: Path
) -> None:
    results, samples = run_lm_eval(tmp_path, "local-completions", system.v1 + "/completions", "splitbus_mc")
    docs = _lines(TASKS / "splitbus_mc.jsonl")
    assert sorted(s["doc_id"] for s in samples) == list(range(len(docs)))
    correct = [_check_question(sample, docs[sample["doc_id"]], reference) for sample in samples]
    assert results["results"]["splitbus_mc"]["acc,none"] == pytest.approx(float(np.mean(correct)))


@pytest.mark.timeout(300)
def test_local_chat_completions_generates_the_model_s_greedy_text(
    system: System, reference: tuple[CausalLM, ModelTokenizer], tmp_path: Path
) -> None:
    results, samples = run_lm_eval(
        tmp_path, "local-chat-completions", system.v1 + "/chat/completions", "splitbus_gen", "--apply_chat_template"
    )
    docs = _lines(TASKS / "splitbus_gen.jsonl")
    assert sorted(s["doc_id"] for s in samples) == list(range(len(docs)))
    for sample in samples:
        (arguments,) = sample["arguments"].values()
        (chat,) = arguments["arg_0"]  # lm-eval's JsonChatStr, logged as a one-item list
        messages = json.loads(chat)
        assert messages[-1] == {"role": "user", "content": docs[sample["doc_id"]]["question"]}
        assert sample["resps"] == [[greedy_chat_text(*reference, messages)]]
    assert any(sample["resps"][0][0] for sample in samples)  # the model said something
    assert results["n-samples"]["splitbus_gen"]["effective"] == len(docs)


def _check_question(sample: dict[str, Any], doc: dict[str, Any], reference: tuple[CausalLM, ModelTokenizer]) -> float:
    """One question's logged sample: each choice's (loglikelihood, is_greedy) as the model gives
    them, and its acc as theirs implies; returns that acc."""
    pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
    assert len(pairs) == len(doc["choices"]) == len(sample["filtered_resps"])
    expected = [continuation_loglikelihood(*reference, *pair) for pair in pairs]
    for (got, got_greedy), (want, want_greedy) in zip(sample["filtered_resps"], expected, strict=True):
        assert float(got) == pytest.approx(want, abs=2e-3)
        assert str(got_greedy) == str(want_greedy)  # lm-eval logs numbers and booleans as text
    correct = float(np.argmax([ll for ll, _ in expected]) == int(sample["target"]))
    assert sample["acc"] == correct
    return correct


def run_lm_eval(tmp_path: Path, model: str, url: str, task: str, *extra: str) -> tuple[dict[str, Any], list[Any]]:
    """lm-eval's CLI from the repository root (the tasks name their data files from there); its
    results and logged samples. ``max_retries=1``: a refused request fails the run at once."""
    out = tmp_path / "out"
    env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "hf")}
    args = ["--model", model, "--model_args", f"base_url={url},model=tiny,max_retries=1", "--tasks", task]
    paths = ["--include_path", str(TASKS), "--output_path", str(out), "--log_samples"]
    cmd = [sys.executable, "-m", "lm_eval", "run", *args, *paths, *extra]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    return json.loads(results.read_text()), _lines(samples)


def continuation_loglikelihood(
    model: CausalLM, tokenizer: ModelTokenizer, context: str, continuation: str
) -> tuple[float, bool]:
    """The continuation's log-probability after the context, and whether greedy decoding would
    produce it: each position's logits by a forward over the whole prefix (no KV cache), log-softmax
    in float64. Tokens are split as lm-eval splits them: the ids of context + continuation, the
    context's first."""
    context_ids = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    logits = model.forward([Chunk(whole[:end], 0) for end in range(len(context_ids), len(whole))]).astype(np.float64)
    logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    targets = whole[len(context_ids) :]
    total = float(sum(logprobs[i, t] for i, t in enumerate(targets)))
    return total, all(int(np.argmax(logprobs[i])) == t for i, t in enumerate(targets))


def greedy_chat_text(model: CausalLM, tokenizer: ModelTokenizer, messages: list[dict[str, Any]]) -> str:
    """The reply's text: greedy tokens, each by a full recompute, up to MAX_GEN_TOKS, an end token,
    or the stop string."""
    ids = tokenizer.encode(tokenizer.render_chat(messages))
    stream, text = TextStream(tokenizer, [UNTIL]), ""
    for _ in range(MAX_GEN_TOKS):
        token = int(np.argmax(model.forward([Chunk(ids, 0)])[0]))
        if token in tokenizer.eos_token_ids:
            return text + stream.flush()
        ids.append(token)
        text += stream.push([token])
        if stream.stopped:
            return text
    return text + stream.flush()


def _lines(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines()]
