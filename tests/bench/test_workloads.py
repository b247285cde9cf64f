"""``bench serve --dataset``'s generators, the Mooncake trace parser, goodput and the ideal hit
ratio: pure functions on small settings (no server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from splitbus.bench.http_client import cached_tokens
from splitbus.bench.serve_trace import RequestResult, ServeConfig, TraceItem, Workload, meets_slos, replay, summarize
from splitbus.bench.workloads import (
    TRACE_BLOCK_TOKENS,
    TraceError,
    ideal_for,
    ideal_hit_ratio,
    make_items,
    make_multiturn,
    make_prefix,
    make_trace_items,
    parse_goodput,
    parse_trace,
    read_trace,
)

PREFIX = Workload("prefix", prefix_groups=3, prefix_len=40, questions_per_group=4, question_len=8)


def test_prefix_is_seeded_interleaved_and_shares_each_groups_prefix() -> None:
    items = make_prefix(PREFIX, 5, 10.0, seed=1)
    assert items == make_prefix(PREFIX, 5, 10.0, seed=1) and items != make_prefix(PREFIX, 5, 10.0, seed=2)
    assert len(items) == 12 and all(len(i.prompt_token_ids) == 48 and i.max_tokens == 5 for i in items)
    groups = [tuple(i.prompt_token_ids[:40]) for i in items]
    assert len(set(groups)) == 3 and all(groups[k] == groups[k % 3] for k in range(12))  # interleaved
    assert len({tuple(i.prompt_token_ids[40:]) for i in items}) == 12  # every question its own
    assert items[0].arrival_s == 0 and all(a.arrival_s <= b.arrival_s for a, b in zip(items, items[1:], strict=False))


def test_multiturn_turns_carry_the_whole_history_and_follow_the_previous_turn() -> None:
    workload = Workload("multiturn", conversations=2, turns=3, turn_len=6)
    items = make_multiturn(workload, 4, float("inf"), seed=3)
    assert items == make_multiturn(workload, 4, float("inf"), seed=3) and len(items) == 6
    assert [i.follows for i in items] == [None, 0, 1, None, 3, 4]
    assert [len(i.prompt_token_ids) for i in items] == [6, 16, 26] * 2  # + the answer stand-in and new tokens
    for earlier, later in ((items[0], items[1]), (items[1], items[2])):
        assert later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
    assert items[0].prompt_token_ids != items[3].prompt_token_ids
    with_system = make_multiturn(Workload("multiturn", conversations=2, turns=3, turn_len=6, system_len=50), 4, 1, 3)
    assert [len(i.prompt_token_ids) for i in with_system] == [56, 66, 76] * 2  # each conversation's own
    assert with_system[0].prompt_token_ids[:50] != with_system[3].prompt_token_ids[:50]


def test_replay_sends_a_turn_only_after_the_previous_one_answered() -> None:
    items = make_multiturn(Workload("multiturn", conversations=2, turns=3, turn_len=2), 1, float("inf"), seed=0)
    log: list[str] = []

    async def send(item: TraceItem) -> RequestResult:
        index = items.index(item)
        log.append(f"start {index}")
        await asyncio.sleep(0.001)
        log.append(f"end {index}")
        return RequestResult(True, len(item.prompt_token_ids), output_tokens=1)

    results, _ = asyncio.run(replay(send, items, 8))
    assert len(results) == 6
    for later in (1, 2, 4, 5):
        assert log.index(f"end {later - 1}") < log.index(f"start {later}")


def _line(ts: object = 0, inputs: object = 600, outputs: object = 3, hashes: object = (1, 2)) -> str:
    """One trace line; any JSON value for each field (the bad lines)."""
    hash_ids = list(hashes) if isinstance(hashes, tuple) else hashes
    return orjson.dumps(
        {"timestamp": ts, "input_length": inputs, "output_length": outputs, "hash_ids": hash_ids}
    ).decode()


def test_a_mooncake_trace_gives_equal_blocks_for_equal_hash_ids() -> None:
    records = parse_trace([_line(1000, 600, 3, (1, 2)), "", _line(1500, 1100, 4, (1, 2, 3)), _line(2000, 100, 1, (9,))])
    items = make_trace_items(records, time_scale=2.0, seed=0)
    assert [i.arrival_s for i in items] == [0.0, 1.0, 2.0]
    assert [len(i.prompt_token_ids) for i in items] == [600, 1100, 100] and [i.max_tokens for i in items] == [3, 4, 1]
    assert items[1].prompt_token_ids[:600] == items[0].prompt_token_ids  # blocks 1, 2 (2 cut to 88 tokens)
    assert items[2].prompt_token_ids != items[0].prompt_token_ids[:100]
    assert make_trace_items(records, 2.0, 0) == items


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (_line(ts=-1), "timestamp"),
        ('{"input_length": 1, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        (_line(inputs=0, hashes=()), "input_length"),
        (_line(inputs=True), "input_length"),  # a bool is not a length
        (_line(outputs=2.5), "output_length"),  # nor a float
        (_line(hashes="12"), "hash_ids must be a list"),
        (_line(hashes=[1, -2]), "hash_ids must be a list"),
        (_line(inputs=600, hashes=(1,)), "1 hash_ids for 600 input tokens"),
    ],
)
def test_a_bad_trace_line_is_an_error_naming_the_line(line: str, why: str) -> None:
    with pytest.raises(TraceError, match=rf"^t\.jsonl:2: .*{why}"):
        parse_trace([_line(), line], "t.jsonl")


def test_an_empty_or_missing_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no records"):
        parse_trace(["", " "], "t")
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "nope.jsonl")


def test_the_ideal_hit_ratio_counts_full_blocks_whose_whole_prefix_was_seen() -> None:
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    assert ideal_hit_ratio([a + b, a + b + [7]], 4) == 8 / 17  # the second prompt reuses 2 blocks
    assert ideal_hit_ratio([a + b, c + b], 4) == 0.0  # the same block behind another prefix is not a hit
    assert ideal_hit_ratio([a + b, a + c + b], 4) == 4 / 20  # the chain breaks at c
    assert ideal_hit_ratio([], 4) == 0.0


def test_the_ideal_hit_ratio_of_the_prefix_and_trace_workloads() -> None:
    config = ServeConfig(output_len=2, workload=PREFIX)
    items = make_items(config, 10.0)
    # 40-token prefixes in 16-token blocks: 2 full blocks shared by the 3 later questions of each group
    assert ideal_for(config, items) == pytest.approx(3 * 3 * 32 / (12 * 48))
    records = parse_trace([_line(0, 1024, 1, (5, 6)), _line(1, 1024, 1, (5, 6))])
    trace = make_trace_items(records, 1.0, seed=0)
    assert ideal_hit_ratio((i.prompt_token_ids for i in trace), TRACE_BLOCK_TOKENS) == 0.5


def test_goodput_bounds_are_parsed_as_vllm_takes_them() -> None:
    assert parse_goodput(["ttft:200", "tpot:20.5", "e2el:1000"]) == {"ttft": 200.0, "tpot": 20.5, "e2el": 1000.0}
    for bad in ("ttfb:10", "ttft:abc", "ttft:0", "ttft:inf", "ttft"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_goodput_counts_requests_that_meet_every_bound() -> None:
    fast = RequestResult(True, 10, output_tokens=5, ttft_s=0.050, e2el_s=0.090)  # TPOT 10 ms
    slow_tokens = RequestResult(True, 10, output_tokens=5, ttft_s=0.050, e2el_s=0.250)  # TPOT 50 ms
    late = RequestResult(True, 10, output_tokens=1, ttft_s=0.300, e2el_s=0.300)
    slos = {"ttft": 100.0, "tpot": 20.0}
    assert [meets_slos(r, slos) for r in (fast, slow_tokens, late)] == [True, False, False]
    assert not meets_slos(RequestResult(False, 10), {"ttft": 1e9})
    summary = summarize([fast, slow_tokens, late], 2.0, slos)
    assert summary["request_goodput"] == 0.5 and summary["request_throughput"] == 1.5
    assert summarize([fast], 1.0)["request_goodput"] is None  # no bounds: none, as vLLM


def test_the_hit_ratio_is_cached_over_prompt_tokens_from_usage() -> None:
    assert cached_tokens({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}) == 4
    for usage in (
        {"prompt_tokens": 9},
        {"prompt_tokens_details": None},
        {"prompt_tokens_details": {"cached_tokens": -1}},
    ):
        assert cached_tokens(usage) == 0  # absent or not a count: nothing reported
    results = [RequestResult(True, 100, 2, cached_tokens=64), RequestResult(True, 60, 2), RequestResult(False, 40)]
    summary = summarize(results, 1.0)
    assert summary["total_cached_tokens"] == 64 and summary["prefix_hit_ratio"] == 0.4


def test_workload_settings_are_checked() -> None:
    for bad in ({"dataset": "sharegpt"}, {"dataset": "trace"}, {"turns": 0}, {"time_scale": 0.0}):
        with pytest.raises(ValueError):
            Workload(**bad)
    with pytest.raises(ValueError, match="goodput"):
        ServeConfig(goodput=(("ttft", -1.0),))
