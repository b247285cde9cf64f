"""``bench serve --dataset``'s workloads beyond the random one: a generated shared-prefix set (as
SGLang's ``generated-shared-prefix``), multi-turn conversations whose turns carry their history,
and a Mooncake-format JSONL trace; with the ideal prefix hit ratio of each (what a cache that
never evicts would reuse) and vLLM's goodput.

Every generator is seeded: the same settings give the same prompts at the same times. Prompts
are token id lists (``/v1/completions`` takes them), drawn from printable byte ids.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from splitbus.bench.serve_trace import (
    FIRST_TOKEN_ID,
    GOODPUT_METRICS,
    LAST_TOKEN_ID,
    ServeConfig,
    TraceItem,
    Workload,
    make_trace,
)

TRACE_BLOCK_TOKENS = 512
"""A Mooncake trace's ``hash_ids`` name blocks of this many tokens."""
MAX_TRACE_LINES = 1_000_000
MAX_TRACE_TOKENS = 1 << 20
"""Bounds on a trace file's lines and on one request's lengths: the file is untrusted input."""


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, LAST_TOKEN_ID + 1, n).tolist()


def _arrivals(rng: np.random.Generator, rate: float, n: int) -> list[float]:
    """Poisson arrival times from 0 (all at 0 for ``inf``)."""
    gaps = np.zeros(n) if math.isinf(rate) else rng.exponential(1.0 / rate, n)
    return (np.cumsum(gaps) - gaps[0]).tolist()


def make_prefix(workload: Workload, output_len: int, rate: float, seed: int) -> list[TraceItem]:
    """Groups × questions; request ``i`` is question ``i // groups`` of group ``i % groups``, so
    consecutive requests go to different groups (interleaved), at Poisson times."""
    rng = np.random.default_rng(seed)
    groups, per_group = workload.prefix_groups, workload.questions_per_group
    prefixes = [_tokens(rng, workload.prefix_len) for _ in range(groups)]
    questions = [[_tokens(rng, workload.question_len) for _ in range(per_group)] for _ in range(groups)]
    arrivals = _arrivals(rng, rate, groups * per_group)
    return [
        TraceItem(arrivals[i], prefixes[i % groups] + questions[i % groups][i // groups], output_len)
        for i in range(groups * per_group)
    ]


def make_multiturn(workload: Workload, output_len: int, rate: float, seed: int) -> list[TraceItem]:
    """Conversations started at Poisson times; turn ``k``'s prompt is every earlier turn's prompt
    tokens and answer, then its own new tokens (the first turn's after the conversation's own
    ``system_len``-token system prompt). The answers are stand-ins: ``output_len`` seeded
    tokens per turn (the tokens a client would send back, of the length it asked for), not what
    the server generated, so the prompts are fixed in advance. Turn ``k`` follows turn ``k - 1``:
    it is sent when that one's answer is complete."""
    rng = np.random.default_rng(seed)
    starts = _arrivals(rng, rate, workload.conversations)
    items: list[TraceItem] = []
    for start in starts:
        history: list[int] = _tokens(rng, workload.system_len)
        for turn in range(workload.turns):
            prompt = history + _tokens(rng, workload.turn_len)
            follows = len(items) - 1 if turn else None
            items.append(TraceItem(start if turn == 0 else 0.0, prompt, output_len, follows))
            history = prompt + _tokens(rng, output_len)
    return items


class TraceError(ValueError):
    """A trace file's line is not a valid Mooncake record; the message names the line."""


@dataclass(frozen=True)
class TraceRecord:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    """Ids of the prompt's 512-token blocks: equal ids, equal blocks (a prefix's chain)."""


def parse_trace(lines: Iterable[str | bytes], name: str = "trace") -> list[TraceRecord]:
    """Every non-blank line validated; a bad one raises ``TraceError`` naming ``name:line``."""
    records: list[TraceRecord] = []
    for number, line in enumerate(lines, 1):
        if number > MAX_TRACE_LINES:
            raise TraceError(f"{name}: more than {MAX_TRACE_LINES:,} lines")
        if line.strip():
            records.append(_record(line, f"{name}:{number}"))
    if not records:
        raise TraceError(f"{name}: no records")
    return records


def read_trace(path: Path) -> list[TraceRecord]:
    try:
        with path.open("rb") as file:
            return parse_trace(file, str(path))
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror}") from None


def _record(line: str | bytes, where: str) -> TraceRecord:
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TraceError(f"{where}: not a JSON object")
    timestamp = _timestamp(data, where)
    inputs, outputs = _length(data, "input_length", where), _length(data, "output_length", where)
    return TraceRecord(timestamp, inputs, outputs, _hash_ids(data, inputs, where))


def _timestamp(data: dict[str, Any], where: str) -> float:
    timestamp = data.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or not 0 <= timestamp < 1e15:
        raise TraceError(f"{where}: timestamp must be a number of ms >= 0")
    return float(timestamp)


def _hash_ids(data: dict[str, Any], inputs: int, where: str) -> tuple[int, ...]:
    """One block hash per 512 prompt tokens, each an integer >= 0."""
    hash_ids = data.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(type(h) is int and h >= 0 for h in hash_ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    if len(hash_ids) != -(-inputs // TRACE_BLOCK_TOKENS):
        raise TraceError(f"{where}: {len(hash_ids)} hash_ids for {inputs} input tokens (one per 512-token block)")
    return tuple(hash_ids)


def _length(data: dict[str, Any], key: str, where: str) -> int:
    value = data.get(key)
    if type(value) is not int or not 1 <= value <= MAX_TRACE_TOKENS:
        raise TraceError(f"{where}: {key} must be an integer in [1, {MAX_TRACE_TOKENS}]")
    return value


def block_tokens(hash_id: int, seed: int) -> list[int]:
    """The 512 tokens of block ``hash_id``: the same for every request (and run) with that seed."""
    return _tokens(np.random.default_rng([seed, hash_id]), TRACE_BLOCK_TOKENS)


def make_trace_items(records: Sequence[TraceRecord], time_scale: float, seed: int) -> list[TraceItem]:
    """Each record at ``(timestamp - first) * time_scale``, its prompt its blocks' tokens (the
    last block cut to ``input_length``)."""
    first = min(r.timestamp_ms for r in records)
    cache: dict[int, list[int]] = {}
    items = []
    for record in sorted(records, key=lambda r: r.timestamp_ms):
        blocks = [cache[h] if h in cache else _put(cache, h, seed) for h in record.hash_ids]
        prompt = [t for block in blocks for t in block][: record.input_length]
        items.append(TraceItem((record.timestamp_ms - first) / 1000 * time_scale, prompt, record.output_length))
    return items


def _put(cache: dict[int, list[int]], hash_id: int, seed: int) -> list[int]:
    cache[hash_id] = block_tokens(hash_id, seed)
    return cache[hash_id]


def ideal_hit_ratio(prompts: Iterable[Sequence[int]], block_size: int) -> float:
    """Prompt tokens in full blocks whose whole prefix (the chain up to and including the block)
    was in an earlier prompt, over all prompt tokens, in the order given: what a prefix cache
    with room for everything would reuse."""
    seen: set[int] = set()
    hits = total = 0
    for prompt in prompts:
        total += len(prompt)
        parent, missed = 0, False
        for start in range(0, len(prompt) - block_size + 1, block_size):
            parent = hash((parent, tuple(prompt[start : start + block_size])))
            if not missed and parent in seen:
                hits += block_size
            else:
                missed = True
                seen.add(parent)
    return hits / total if total else 0.0


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``ttft:MS tpot:MS e2el:MS`` (any of them) as vLLM's ``--goodput`` takes them."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {spec!r}: the metric must be one of {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of ms") from None
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"--goodput {spec!r}: the bound must be > 0 ms")
        slos[name] = ms
    return slos


def make_items(config: ServeConfig, rate: float) -> list[TraceItem]:
    """The run's requests by ``config.workload.dataset`` (a trace keeps its own times: ``rate``
    is not used)."""
    workload = config.workload
    if workload.dataset == "prefix":
        return make_prefix(workload, config.output_len, rate, config.seed)
    if workload.dataset == "multiturn":
        return make_multiturn(workload, config.output_len, rate, config.seed)
    if workload.dataset == "trace":
        assert workload.trace_file is not None  # Workload checks it
        return make_trace_items(read_trace(Path(workload.trace_file)), workload.time_scale, config.seed)
    return make_trace(config, rate)


def ideal_for(config: ServeConfig, items: Sequence[TraceItem]) -> float:
    """The ideal prefix hit ratio of the run's prompts, in the order they are sent."""
    return ideal_hit_ratio((item.prompt_token_ids for item in items), config.workload.block_size)


def run_config(config: ServeConfig, run: int) -> ServeConfig:
    """The config of the ``run``-th run of a series (0, 1, ...: a rate, a concurrency): its own
    seed, ``seed + run``. One system serves every run of a series, and the same prompts again
    would find what the earlier runs cached: a hit ratio over the ideal, and a TTFT that
    flatters the system against a baseline that starts empty."""
    return replace(config, seed=config.seed + run)


HIT_RATIO_SLACK = 1e-9
"""Float rounding only: a measured ratio above the ideal by more than this is a real excess."""


def above_ideal(runs: Iterable[dict[str, Any]]) -> list[str]:
    """Why each run whose measured prefix hit ratio exceeds its workload's ideal one cannot be
    trusted, naming both figures (none: every run is within its ideal). The ideal counts every
    reuse a cache that never evicts could make of this run's own prompts; more than that means
    the server had them cached before the run began, so its latencies flatter it."""
    return [_excess(run) for run in runs if _exceeds(run)]


def _exceeds(run: dict[str, Any]) -> bool:
    measured, ideal = run.get("prefix_hit_ratio"), run.get("ideal_prefix_hit_ratio")
    return isinstance(measured, float | int) and isinstance(ideal, float | int) and measured > ideal + HIT_RATIO_SLACK


def _excess(run: dict[str, Any]) -> str:
    where = f"{run['path']} at {run['request_rate']} req/s"
    if "max_concurrency" in run:
        where += f", max concurrency {run['max_concurrency']}"
    return (
        f"{where}: prefix hit ratio {run['prefix_hit_ratio']:.3%} exceeds its ideal {run['ideal_prefix_hit_ratio']:.3%}"
        " (the server had this run's prompts cached before it began: its figures flatter it; restart the server"
        " or pass another --seed)"
    )
