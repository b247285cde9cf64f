"""Prefix caching end to end (sim engine, one mixed worker): the same prompt twice, the second
reply's usage says its prefix was cached."""

from __future__ import annotations

import time
from pathlib import Path

import openai

from tests.e2e.conftest import start_system, stop_system

PROMPT = "the same long system prompt, shared by every request of this test. " * 2


def test_a_repeated_prompt_reports_its_cached_tokens(tmp_path: Path) -> None:
    system = start_system(tmp_path, "--mixed", "1", "--prefill", "0", "--decode", "0")
    try:
        client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
        first, second = (client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4) for _ in range(2))
        assert first.usage is not None and second.usage is not None
        prompt = first.usage.prompt_tokens
        assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details is not None
        # every full block of 16 but the one holding the last prompt token
        assert second.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16 > 0
    finally:
        assert stop_system(system) == []


def test_a_second_request_with_the_same_prefix_prefills_only_its_suffix_where_the_prefix_is(tmp_path: Path) -> None:
    """Splitwise with two prefill workers: each prefix's second request goes to the prefill
    worker that holds it (the scheduler's index, fed by the workers' KV events) and computes only
    its suffix; D reports P's cached tokens in the usage. By load alone, with both prefill workers
    idle, each second request would find the holder one time in two."""
    system = start_system(tmp_path, "--prefill", "2", "--decode", "1")
    try:
        client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
        prefixes = [f"prefix {i}: " + "a long shared system prompt " * 4 for i in range(8)]
        firsts = [client.completions.create(model="tiny", prompt=p + "first", max_tokens=4) for p in prefixes]
        # until the registry view (0.1 s) shows the last first request's prefill tokens gone from its
        # worker's queue: while this replica still counts them there, that worker's queue outweighs its
        # credit for a 7-block prefix, and the next request would rightly go to the idle one
        time.sleep(0.3)
        seconds = [client.completions.create(model="tiny", prompt=p + "second", max_tokens=4) for p in prefixes]
        for first, second in zip(firsts, seconds, strict=True):
            assert first.usage is not None and second.usage is not None
            assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            shared = (first.usage.prompt_tokens - len("first")) // 16 * 16  # the prefix's full blocks
            assert second.usage.prompt_tokens_details.cached_tokens >= shared > 0
    finally:
        assert stop_system(system) == []
