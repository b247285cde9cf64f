"""``bench serve`` cannot flatter itself: each run of a series draws its own requests (a system
that serves every run finds nothing of an earlier run's cached), a run whose measured prefix hit
ratio exceeds its ideal is named with both figures, and the engine driven directly caches as the
stack's worker does. Pure functions, and the direct loop in-process (no server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from splitbus.bench.serve_direct import DirectLoop
from splitbus.bench.serve_trace import ServeConfig, TraceItem, Workload
from splitbus.bench.workloads import above_ideal, ideal_hit_ratio, make_items, run_config
from splitbus.worker import engines
from splitbus.worker.config import WorkerConfig
from splitbus.worker.engines.sim import DEFAULT_KV_BLOCKS

RANDOM = ServeConfig(num_prompts=30, input_len=64, output_len=4, seed=7)
PREFIX = ServeConfig(seed=7, workload=Workload("prefix", prefix_groups=2, prefix_len=32, questions_per_group=3))


def _series(config: ServeConfig, rates: tuple[float, ...]) -> list[list[TraceItem]]:
    """The requests of each run of a series, as ``bench serve`` draws them (``run_config``)."""
    return [make_items(run_config(config, i), rate) for i, rate in enumerate(rates)]


@pytest.mark.parametrize("config", [RANDOM, PREFIX], ids=["random", "prefix"])
def test_each_rate_draws_prompts_no_other_rate_sends(config: ServeConfig) -> None:
    series = _series(config, (10.0, 25.0, 50.0))
    prompts = [set(map(tuple, _prompts(run))) for run in series]
    assert sum(map(len, prompts)) == len(set().union(*prompts))  # no prompt in two runs
    assert series == _series(config, (10.0, 25.0, 50.0))  # still seeded: the same series again
    # A cache that serves the whole series never evicting finds no more than each run's own reuse.
    block = config.workload.block_size
    own = sum(ideal_hit_ratio(_prompts(run), block) * _tokens(run) for run in series)
    every = [prompt for run in series for prompt in _prompts(run)]
    assert ideal_hit_ratio(every, block) == pytest.approx(own / sum(map(_tokens, series)))


def _prompts(run: list[TraceItem]) -> list[list[int]]:
    return [item.prompt_token_ids for item in run]


def _tokens(run: list[TraceItem]) -> int:
    return sum(map(len, _prompts(run)))


def test_the_random_series_is_all_misses_even_for_one_cache() -> None:
    series = _series(RANDOM, (10.0, 25.0, 50.0))
    every = [prompt for run in series for prompt in _prompts(run)]
    assert ideal_hit_ratio(every, RANDOM.workload.block_size) == 0.0
    # The same seed for every rate (as before) would have sent the first run's prompts again.
    same = [make_items(RANDOM, rate) for rate in (10.0, 25.0)]
    assert [i.prompt_token_ids for i in same[0]] == [i.prompt_token_ids for i in same[1]]


def _row(measured: float, ideal: float) -> dict[str, object]:
    return {"path": "splitbus", "request_rate": 25.0, "prefix_hit_ratio": measured, "ideal_prefix_hit_ratio": ideal}


def test_a_hit_ratio_within_its_ideal_passes() -> None:
    assert above_ideal([_row(0.0, 0.0), _row(0.25, 0.5), _row(0.5, 0.5), {"path": "http", "request_rate": 1}]) == []


def test_a_hit_ratio_above_its_ideal_is_named_with_both_figures() -> None:
    (message,) = above_ideal([_row(0.1, 0.2), _row(0.933, 0.0)])
    assert message.startswith("splitbus at 25.0 req/s: prefix hit ratio 93.300% exceeds its ideal 0.000%")
    (level,) = above_ideal([{**_row(0.5, 0.25), "request_rate": "inf", "max_concurrency": 16}])
    assert "inf req/s, max concurrency 16: prefix hit ratio 50.000% exceeds its ideal 25.000%" in level


def test_the_direct_engine_has_the_stack_workers_cache(tmp_path: Path) -> None:
    """The sim engine driven directly is built with the settings a worker of ``up`` has (prefix
    cache, block size, KV blocks), and a prompt sent again finds its full blocks cached."""
    engines.get("sim").make_default_model(tmp_path)
    prompt = list(range(40, 80))  # 40 tokens: 2 full blocks of 16, then 8

    async def twice() -> list[int]:
        loop = DirectLoop.load(tmp_path, "tiny")
        assert (loop.engine.block_size, loop.engine.total_blocks) == (WorkerConfig.block_size, DEFAULT_KV_BLOCKS)
        engine = asyncio.create_task(loop.run())
        try:
            return [(await loop.send(TraceItem(0.0, prompt, 2))).cached_tokens for _ in range(2)]
        finally:
            engine.cancel()

    assert asyncio.run(twice()) == [0, 32]
