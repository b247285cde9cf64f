"""The paddle engine's expert load (``ExpertParallel.expert_load``): the tokens each held expert
took, counted against the numpy reference's own routing (tests/worker/engines/paddle/test_moe.py),
the weights it holds against the checkpoint's tensors, and reads that never see a forward half
counted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.bus.records import ExpertLoad
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.engines.paddle.engine import PaddleEngine
from splitbus.worker.engines.paddle.model import load_model
from splitbus.worker.engines.paddle.tiny import make_tiny_model
from splitbus.worker.sequence import Sequence
from splitbus.worker.text import TextStream
from tests.worker.engines.paddle.test_moe import Reference

EXPERTS, PER_TOKEN, MOE_LAYERS = 4, 2, 2  # the tiny Mixtral: every one of its 2 layers is MoE
PROMPT = [5, 77, 3, 140, 9, 9, 200, 31, 64]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mixtral") / "m", "mixtral", seed=4, hidden=64, layers=2)


def _routed(folder: Path, tokens: list[int]) -> np.ndarray:
    """Tokens each expert took in the reference's forward of ``tokens`` (one sequence)."""
    reference = Reference(folder)
    reference.logits(tokens)
    return np.array([reference.took[e] for e in range(EXPERTS)])


def _engine(folder: Path, shard: tuple[int, int] = (0, 1)) -> PaddleEngine:
    return PaddleEngine(load_model(folder, shard), (), total_blocks=16, block_size=16)


def _seq(folder: Path) -> Sequence:
    request = GenerateRequest("r", "m", PROMPT, SamplingParams(max_tokens=4), "api", 0)
    return Sequence(Task("mixed", request, peer=""), "0-0", TextStream(ModelTokenizer.load(folder), []))


def test_the_counts_are_the_tokens_the_reference_routes_to_each_expert(mixtral_dir: Path) -> None:
    engine, seq = _engine(mixtral_dir), _seq(mixtral_dir)
    before = engine.expert_load()
    assert before is not None and before == ExpertLoad(EXPERTS, (0, EXPERTS), (0,) * 4, (0,) * 4, before.weight_bytes)
    assert engine.reserve(seq, len(PROMPT) + 4)
    seq.output_ids.append(asyncio.run(engine.prefill([seq]))[0])
    prompt = _routed(mixtral_dir, PROMPT)
    assert prompt.sum() == len(PROMPT) * PER_TOKEN * MOE_LAYERS and np.count_nonzero(prompt) > 1
    load = engine.expert_load()
    assert load is not None and load.last_forward == load.total == tuple(prompt)

    asyncio.run(engine.decode([seq]))  # the first generated token, at position len(PROMPT)
    both = _routed(mixtral_dir, PROMPT + seq.output_ids)
    load = engine.expert_load()
    assert load is not None and load.last_forward == tuple(both - prompt) and load.total == tuple(both)

    asyncio.run(engine.idle())  # token 0 at position 0: a forward, but no expert's load
    assert _routed(mixtral_dir, [0]).sum() > 0  # the dummy token is routed: it would have counted
    load = engine.expert_load()
    assert load is not None and load.last_forward == (0,) * EXPERTS and load.total == tuple(both)


def test_a_read_during_a_forward_sees_the_last_finished_one(mixtral_dir: Path) -> None:
    """The forward runs on the Paddle thread while heartbeats read the load on the event loop: a
    read between the model's counting and the forward's end sees the previous forward's counts,
    consistent with its total, not the model's counts of the forward still running."""
    engine, seq = _engine(mixtral_dir), _seq(mixtral_dir)
    model_run, seen = engine.model.run, []

    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        logits = model_run(*args, **kwargs)
        seen.append(engine.expert_load())  # the model has counted this forward; the engine not yet
        return logits

    engine.model.run = run  # type: ignore[method-assign]
    assert engine.reserve(seq, len(PROMPT) + 4)
    asyncio.run(engine.prefill([seq]))
    asyncio.run(engine.idle())
    first, second = seen
    assert first is not None and first.last_forward == first.total == (0,) * EXPERTS
    assert second is not None and second.last_forward == second.total == tuple(_routed(mixtral_dir, PROMPT))


def test_each_rank_holds_its_share_and_says_how_many_bytes(mixtral_dir: Path) -> None:
    tensors = load_file(str(mixtral_dir / "model.safetensors"))
    expert_bytes = {e: 0 for e in range(EXPERTS)}
    dense = 0
    for name, array in tensors.items():
        if ".experts." in name:
            expert_bytes[int(name.split(".experts.")[1].split(".")[0])] += 4 * array.size  # held as float32
        else:
            dense += 4 * array.size
    if "lm_head.weight" not in tensors:  # tied: the engine keeps the head as a copy of its own
        dense += 4 * tensors["model.embed_tokens.weight"].size
    whole = _engine(mixtral_dir).expert_load()
    assert whole is not None and whole.weight_bytes == (dense, sum(expert_bytes.values()))
    second = _engine(mixtral_dir, (1, 2)).expert_load()
    assert second is not None and second.held == (2, 4) and second.experts == EXPERTS
    assert second.weight_bytes == (dense, expert_bytes[2] + expert_bytes[3])
    assert second.last_forward == second.total == (0, 0)


def test_a_dense_model_has_no_expert_load(tmp_path: Path) -> None:
    assert _engine(make_tiny_model(tmp_path / "llama", "llama", seed=1, hidden=64, layers=2)).expert_load() is None
