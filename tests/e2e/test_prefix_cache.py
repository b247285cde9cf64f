"""Prefix caching end to end (sim engine, one mixed worker): the same prompt twice, the second
reply's usage says its prefix was cached."""

from __future__ import annotations

import time
from pathlib import Path

import openai

from tests.e2e.conftest import start_system, stop_system

PROMPT = "the same long system prompt, shared by every request of this test. " * 2
KEYS = ("sk-tenant-a-0123456789", "sk-tenant-b-0123456789")
PUBLIC = "System: you are ACME's help bot."  # 32 tokens (one a byte): two full blocks of 16
SECRET = "door code 7F3A91"  # the third block
VICTIM = PUBLIC + SECRET + " Never tell anyone the door code. User: hi"


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
    idle, each second request would find the holder one time in two. With an API key, so every
    chain (the API's, the workers' caches and events) is salted with its tenant's salt."""
    system = start_system(tmp_path, "--prefill", "2", "--decode", "1", environ={"SPLITBUS_API_KEYS": KEYS[0]})
    try:
        client = openai.OpenAI(base_url=system.v1, api_key=KEYS[0], max_retries=0, timeout=60)
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


def _cached(client: openai.OpenAI, prompt: str, **body: object) -> int:
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body=body or None)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_another_tenants_prompt_cannot_be_guessed_through_cached_tokens(tmp_path: Path) -> None:
    """Issue 34's attack: tenant B guesses the next block of tenant A's system prompt and reads
    ``cached_tokens``. Every key is a tenant with chains of its own (salted): B's right and wrong
    guesses show the same count (its own public prefix), while within A the same probe does tell
    them apart (what B saw before tenants), and A's repeats reuse its cache as they did."""
    assert len(PUBLIC) == len(SECRET) * 2 == 32
    system = start_system(
        tmp_path, "--mixed", "1", "--prefill", "0", "--decode", "0", environ={"SPLITBUS_API_KEYS": ",".join(KEYS)}
    )
    try:
        victim, attacker = (openai.OpenAI(base_url=system.v1, api_key=k, max_retries=0, timeout=60) for k in KEYS)
        assert _cached(victim, VICTIM) == 0
        _cached(attacker, PUBLIC + "door code 000000 ?")  # B's own public prefix, cached for both guesses
        right = _cached(attacker, PUBLIC + SECRET + " ?")
        wrong = _cached(attacker, PUBLIC + "door code 5B20C4 ?")
        assert right == wrong == 32
        # the same probe within A: its blocks are A's, so the right guess reuses one block more
        assert (_cached(victim, PUBLIC + SECRET + " ?"), _cached(victim, PUBLIC + "door code 2C7D15 ?")) == (48, 32)
        assert _cached(victim, VICTIM) == (len(VICTIM) - 1) // 16 * 16  # one key: reuse as before
    finally:
        assert stop_system(system) == []


def test_a_cache_salt_shares_cached_prompts_only_within_itself(tmp_path: Path) -> None:
    """vLLM's ``cache_salt``, with no keys configured (one tenant): the same prompt under another
    salt, or none, reuses nothing; under its own salt, all of its full blocks."""
    system = start_system(tmp_path, "--mixed", "1", "--prefill", "0", "--decode", "0")
    try:
        client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
        full = (len(VICTIM) - 1) // 16 * 16
        assert (_cached(client, VICTIM), _cached(client, VICTIM)) == (0, full)  # unsalted: reuse as before
        assert _cached(client, VICTIM, cache_salt="team-1") == 0
        assert _cached(client, VICTIM, cache_salt="team-2") == 0
        assert _cached(client, VICTIM, cache_salt="team-1") == full
    finally:
        assert stop_system(system) == []
