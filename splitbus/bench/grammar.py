"""``splitbus bench grammar``: what structured output costs a worker per token (issue 37's target:
a JSON-schema request's per-token overhead <= 0.5 ms on the CPU, the mask).

For each workload (a JSON schema, ``json_object``, a regex) and a document its grammar accepts,
tokenized with the model's own tokenizer, the worker's path is replayed token by token: the
grammar's allowed set (``Constraint.allowed``: llguidance's mask, unpacked to one bool a token),
then that mask applied to a row of the model's vocabulary size (``apply_mask``: what the paddle
engine's ``_sample`` does before drawing), then the token taken (``Constraint.advance``, on the
worker's event loop). Each run builds a fresh constraint; the garbage collector is off in the
timed loop. Also timed once: building llguidance's view of the vocabulary (once per model and
process), the API's compile (``compile_grammar``) and a worker's matcher build, per workload.
An unconstrained request pays none of this: ``mask_logits`` returns its row untouched.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from splitbus.grammar.constraint import Constraint, apply_mask
from splitbus.grammar.request import GrammarSpec, compile_grammar, grammar_spec
from splitbus.grammar.tokenizer import grammar_tokenizer
from splitbus.tokenization import ModelTokenizer

TARGET_MS = 0.5
"""Issue 37's bound on a JSON-schema request's overhead per token (mask, apply, advance)."""
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "status": {"enum": ["active", "inactive", "banned"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "status", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada.lovelace@example.org",
    "status": "active",
    "tags": ["mathematics", "analytical engine", "poetry of science"],
    "address": {"street": "12 St James's Square, London", "zip": "10115"},
}
WORKLOADS: dict[str, tuple[dict[str, Any], str]] = {
    "json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
        json.dumps(DOCUMENT, indent=2),
    ),
    "json_object": ({"response_format": {"type": "json_object"}}, json.dumps(DOCUMENT, indent=2)),
    "regex": ({"guided_regex": r"[A-Z][a-z]+( [A-Z][a-z]+)*, [0-9]{4}-[0-9]{2}-[0-9]{2}"}, "Ada Lovelace, 1815-12-10"),
}
"""Name -> (the request's fields, an output its grammar accepts)."""


def run_grammar_bench(
    tokenizer: ModelTokenizer, vocab_rows: int, runs: int = 20, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """The report: the one-off costs and, per workload, the per-token times in microseconds.
    ``vocab_rows``: the model's logit row length (its config's vocab_size: at least the tokenizer's)."""
    started = time.perf_counter()
    llg = grammar_tokenizer(tokenizer)
    tokenizer_s = time.perf_counter() - started
    progress(f"llguidance's tokenizer for {tokenizer.name} ({tokenizer.vocab_size} tokens): {tokenizer_s:.2f} s")
    results = {}
    for name, (body, document) in WORKLOADS.items():
        spec = grammar_spec(body)
        assert spec is not None
        results[name] = _workload(spec, tokenizer.encode(document), llg, vocab_rows, runs)
        progress(f"{name}: {results[name]['tokens']} tokens, {results[name]['total_us']['mean']:.0f} us a token")
    met = results["json_schema"]["total_us"]["mean"] <= TARGET_MS * 1000
    return {
        "model": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "vocab_rows": vocab_rows,
        "runs": runs,
        "tokenizer_build_s": tokenizer_s,
        "target_ms": TARGET_MS,
        "target_met": met,
        "workloads": results,
    }


def _workload(spec: GrammarSpec, tokens: list[int], llg: Any, vocab_rows: int, runs: int) -> dict[str, Any]:
    started = time.perf_counter()
    grammar = compile_grammar(spec, llg)
    compile_ms = (time.perf_counter() - started) * 1000
    logits = np.random.default_rng(0).standard_normal(vocab_rows).astype(np.float32)
    times: dict[str, list[float]] = {"mask": [], "apply": [], "advance": [], "build": []}
    for _ in range(runs):
        _one_run(llg, grammar, tokens, logits, times)
    total = [m + a + v for m, a, v in zip(times["mask"], times["apply"], times["advance"], strict=True)]
    return {
        "tokens": len(tokens),
        "compile_ms": compile_ms,
        "build_ms": statistics.median(times["build"]) / 1000,
        **{f"{part}_us": _summary(times[part]) for part in ("mask", "apply", "advance")},
        "total_us": _summary(total),
    }


def _one_run(llg: Any, grammar: str, tokens: list[int], logits: np.ndarray, times: dict[str, list[float]]) -> None:
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        constraint = Constraint.build(llg, grammar)
        times["build"].append((time.perf_counter_ns() - t0) / 1000)
        for token in tokens:
            t0 = time.perf_counter_ns()
            allowed = constraint.allowed()
            t1 = time.perf_counter_ns()
            masked = apply_mask(allowed, logits)
            t2 = time.perf_counter_ns()
            constraint.advance(token)
            t3 = time.perf_counter_ns()
            assert np.isfinite(masked[token]), "the document breaks its grammar"
            times["mask"].append((t1 - t0) / 1000)
            times["apply"].append((t2 - t1) / 1000)
            times["advance"].append((t3 - t2) / 1000)
    finally:
        gc.enable()


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max": ordered[-1],
    }


def vocab_rows(folder: Path, tokenizer: ModelTokenizer) -> int:
    """The model's logit row length: config.json's vocab_size (padded past the tokenizer's, often)."""
    try:
        rows = json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        rows = None
    return max(rows if isinstance(rows, int) else 0, tokenizer.vocab_size)
