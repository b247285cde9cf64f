"""Prefix caching end to end (sim engine, one mixed worker): the same prompt twice, the second
reply's usage says its prefix was cached."""

from __future__ import annotations

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
