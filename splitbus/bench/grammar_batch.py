"""``splitbus bench grammar``'s batch part: what one constrained request costs the other requests
of its decode batch (issue 37's target: they are not slowed beyond the spread).

The worker's own engine (``PaddleEngine``) on the model at ``--model`` (random weights of the tiny
test shape for a folder that holds only a tokenizer) decodes two batches of B sequences in one KV
cache, alternately step after step: (a) every sequence unconstrained, (b) the same with ONE
sequence under the JSON-schema workload's grammar. A step is what a worker does for a decode:
``engine.decode`` (the forward, then ``_sample`` row by row: the logits processors, the grammar's
mask for the constrained row, the sampler), then, on the event loop, ``Sequence.add_token`` of each
token (detokenizing it; the grammar taking it). Both batches have the same prompt length, reach
the same positions, sample greedily (the sampler's own cost, the same both sides, would only widen
the spread), and which of the two goes first swaps every pair, so that a load that comes and goes
on the machine meets both. Each run starts both batches afresh (new random prompts, prefilled
untimed, a fresh matcher) and warms up for ``warmup`` pairs; a constrained sequence whose grammar
completes gets a fresh matcher before its next step, untimed (a worker would have taken another
request). The garbage collector is off during a run's steps, both sides alike. The spread
reported is that of (a)'s step times.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitbus.bench.grammar import WORKLOADS
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.grammar.constraint import Constraint
from splitbus.grammar.request import compile_grammar, grammar_spec
from splitbus.grammar.tokenizer import grammar_tokenizer
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.engines.paddle.engine import PaddleEngine
from splitbus.worker.engines.paddle.model import load_model
from splitbus.worker.engines.paddle.tiny import tiny_config
from splitbus.worker.sequence import Sequence
from splitbus.worker.text import TextStream

WORKLOAD = "json_schema"
"""The workload (``splitbus.bench.grammar.WORKLOADS``) whose grammar the constrained sequence runs under."""
MAX_TOKENS = 1 << 20
"""No sequence of the bench ends by length: the steps decide."""


@dataclass(frozen=True)
class BatchBenchConfig:
    batches: tuple[int, ...] = (8, 32)
    """The batch sizes B measured."""
    runs: int = 3
    """Runs at each B, each on fresh batches and a fresh matcher."""
    steps: int = 8
    """Timed step pairs ((a) then (b), or (b) then (a)) in each run."""
    warmup: int = 2
    """Untimed step pairs at the start of each run."""
    prompt_tokens: int = 16
    """Each sequence's prompt (random token ids): prefilled before the run, untimed."""
    block_size: int = 16
    """The KV cache's block size (the worker's default)."""

    def __post_init__(self) -> None:
        if min(self.batches, default=1) < 1 or min(self.runs, self.steps) < 1:
            raise ValueError("batch sizes, batch runs and batch steps must be at least 1")

    def blocks_per_sequence(self) -> int:
        return -(-(self.prompt_tokens + self.warmup + self.steps + 1) // self.block_size)


def run_batch(
    folder: Path,
    tokenizer: ModelTokenizer,
    vocab_rows: int,
    config: BatchBenchConfig,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """``run_batch_bench`` on the model in ``folder`` (``paddle_engine``), under ``WORKLOAD``'s grammar."""
    engine, model = paddle_engine(folder, tokenizer, vocab_rows, config)
    progress(f"batch: the paddle engine on {model}")
    return run_batch_bench(engine, model, tokenizer, matchers(tokenizer, WORKLOADS[WORKLOAD][0]), config, progress)


def paddle_engine(
    folder: Path, tokenizer: ModelTokenizer, vocab_rows: int, config: BatchBenchConfig
) -> tuple[PaddleEngine, str]:
    """The worker's engine, and which model it runs, on one math thread (a worker's default), with
    room for the two batches of the largest B: on the model in ``folder``, or on random weights of
    the tiny test shape when the folder holds only a tokenizer (speed does not depend on their values)."""
    from splitbus.bench.engine import random_model
    from splitbus.gpu_ops import device

    device.select_device(1)
    has_weights = any(folder.glob("*.safetensors"))
    model = load_model(folder) if has_weights else random_model(tiny_config("llama", vocab_rows))
    blocks = 1 + 2 * max(config.batches) * config.blocks_per_sequence()  # block 0: the engine's scratch
    name = tokenizer.name if has_weights else f"tiny test shape, random weights, {vocab_rows} logits"
    return PaddleEngine(model, tokenizer.eos_token_ids, blocks, config.block_size), name


def matchers(tokenizer: ModelTokenizer, body: dict[str, Any]) -> Callable[[], Constraint]:
    """A builder of fresh matchers of the grammar ``body`` asks for, compiled once as the API does."""
    llg = grammar_tokenizer(tokenizer)
    spec = grammar_spec(body)
    if spec is None:
        raise ValueError("the workload asks for no grammar")
    grammar = compile_grammar(spec, llg)
    return lambda: Constraint.build(llg, grammar)


@dataclass
class _Side:
    """One batch of a run and its step times (seconds)."""

    batch: list[Sequence]
    times: list[float]


def run_batch_bench(
    engine: PaddleEngine,
    model: str,
    tokenizer: ModelTokenizer,
    constraint: Callable[[], Constraint],
    config: BatchBenchConfig,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The report: per batch size, the step times of (a) and (b) and their difference.
    ``constraint`` builds a fresh matcher of the grammar the constrained sequence runs under; the
    engine holds at least ``2 * max(batches) * config.blocks_per_sequence()`` free blocks."""
    results = []
    for b in config.batches:
        results.append(asyncio.run(_at_batch(engine, tokenizer, constraint, config, b)))
        r = results[-1]
        progress(
            f"batch {b}: (a) {r['a_ms']['p50']:.2f} ms, (b) {r['b_ms']['p50']:.2f} ms a step "
            f"({r['diff_ms']:+.3f} ms); (a) p10-p90 {r['a_ms']['p10']:.2f}-{r['a_ms']['p90']:.2f} ms"
        )
    return {
        "model": model,
        "workload": WORKLOAD,
        "runs": config.runs,
        "steps": config.steps,
        "warmup": config.warmup,
        "prompt_tokens": config.prompt_tokens,
        "results": results,
    }


async def _at_batch(
    engine: PaddleEngine,
    tokenizer: ModelTokenizer,
    constraint: Callable[[], Constraint],
    config: BatchBenchConfig,
    b: int,
) -> dict[str, Any]:
    a_times: list[float] = []
    b_times: list[float] = []
    run_p50: list[tuple[float, float]] = []
    restarts = 0
    for run in range(config.runs):
        sides = [await _side(engine, tokenizer, config, b, (run, side)) for side in range(2)]
        sides[1].batch[0].grammar = constraint()
        restarts += await _steps(engine, sides, constraint, config)
        for seq in (*sides[0].batch, *sides[1].batch):
            engine.release(seq)
        a_times += sides[0].times
        b_times += sides[1].times
        run_p50.append((statistics.median(sides[0].times), statistics.median(sides[1].times)))
    return _summary_of(b, a_times, b_times, run_p50, restarts)


async def _side(
    engine: PaddleEngine, tokenizer: ModelTokenizer, config: BatchBenchConfig, b: int, key: tuple[int, int]
) -> _Side:
    """A batch of ``b`` fresh sequences, their prompts prefilled and their first token added."""
    batch = [_sequence(tokenizer, config, engine.vocab_size, (*key, row)) for row in range(b)]
    for seq in batch:
        if not engine.reserve(seq, config.blocks_per_sequence() * config.block_size):
            raise RuntimeError(f"the bench's KV cache has no room for a batch of {b}")
    for seq, token in zip(batch, await engine.prefill(batch), strict=True):
        seq.add_token(token, engine.eos_token_ids)
    return _Side(batch, [])


def _sequence(tokenizer: ModelTokenizer, config: BatchBenchConfig, vocab: int, key: tuple[int, ...]) -> Sequence:
    # Random prompts, distinct for every (run, side, row): no sequence takes another's cached blocks.
    prompt = np.random.default_rng(key).integers(0, min(vocab, tokenizer.vocab_size), config.prompt_tokens)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = GenerateRequest("-".join(map(str, key)), tokenizer.name, prompt.tolist(), sampling, "bench", 0)
    return Sequence(Task("mixed", request), "0-0", TextStream(tokenizer, []))


async def _steps(
    engine: PaddleEngine, sides: list[_Side], constraint: Callable[[], Constraint], config: BatchBenchConfig
) -> int:
    """The run's step pairs, each side's timed ones recorded; how many fresh matchers it took."""
    restarts = 0
    gc.disable()
    try:
        for pair in range(config.warmup + config.steps):
            for side in sides if pair % 2 else sides[::-1]:
                took = await _step(engine, side.batch)
                if pair >= config.warmup:
                    side.times.append(took)
            restarts += _restart(sides[1].batch[0], constraint)
    finally:
        gc.enable()
    return restarts


async def _step(engine: PaddleEngine, batch: list[Sequence]) -> float:
    """One decode step as a worker runs it (``WorkerCore.emit`` adds each token); its seconds."""
    start = time.perf_counter()
    tokens = await engine.decode(batch)
    for seq, token in zip(batch, tokens, strict=True):
        seq.add_token(token, engine.eos_token_ids)
    return time.perf_counter() - start


def _restart(seq: Sequence, constraint: Callable[[], Constraint]) -> int:
    """A constrained sequence whose grammar has ended takes a fresh matcher (1), else 0."""
    if seq.finish_reason is None:
        return 0
    seq.grammar, seq.finish_reason = constraint(), None
    return 1


def _summary_of(
    b: int, a_times: list[float], b_times: list[float], run_p50: list[tuple[float, float]], restarts: int
) -> dict[str, Any]:
    a, c = _ms(a_times), _ms(b_times)
    paired = sorted((y - x) * 1000 for x, y in zip(a_times, b_times, strict=True))
    diff = c["p50"] - a["p50"]
    return {
        "batch": b,
        "steps": len(a_times),
        "a_ms": a,
        "b_ms": c,
        "diff_ms": diff,
        "diff_pct": diff / a["p50"] * 100,
        "paired_diff_ms": {"p10": _at(paired, 0.1), "p50": _at(paired, 0.5), "p90": _at(paired, 0.9)},
        "run_p50_ms": [{"a": x * 1000, "b": y * 1000} for x, y in run_p50],
        "within_spread": a["p10"] <= c["p50"] <= a["p90"],
        "grammar_restarts": restarts,
    }


def _ms(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(s * 1000 for s in seconds)
    return {
        "min": ordered[0],
        "p10": _at(ordered, 0.1),
        "p50": _at(ordered, 0.5),
        "p90": _at(ordered, 0.9),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }


def _at(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values (nearest rank)."""
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]
