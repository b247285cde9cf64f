"""The dispatch protocol's own rules (the script against real Redis: tests/placement/test_dispatcher.py)."""

from __future__ import annotations

import re

import redis.asyncio as aioredis

from splitbus.bus import dispatch
from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.records import blocks_needed


def test_the_script_builds_no_key_name() -> None:
    """Every key it touches comes in KEYS (Redis Cluster routes a script by them)."""
    lua = dispatch._DISPATCH.source
    assert ".." not in lua and "sb:" not in lua
    touched = re.findall(r"redis\.call\('\w+', (\w+)", lua)
    assert touched and all(name in ("KEYS", "worker", "tasks") for name in touched)
    assert "local worker, tasks, a = KEYS[6 + 3 * i], KEYS[7 + 3 * i]" in lua


def test_entries_are_named_by_the_keys_module(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    keys = bus_config.keys
    script = dispatch.DispatchScript(redis, bus_config, 60)
    first = script.request_entry("1-0", "r")
    assert (first.stream, first.mark) == (keys.requests, keys.dispatched("r"))
    moved = script.task_entry("p", "2-0", "r")
    assert (moved.stream, moved.mark) == (keys.tasks("p"), keys.dispatched("r:2-0"))


def test_a_request_reserves_the_blocks_of_its_prompt_and_its_longest_answer() -> None:
    request = GenerateRequest("r", "m", [1] * 100, SamplingParams(max_tokens=28), "api", 0)
    assert [blocks_needed(request, size) for size in (16, 128, 0)] == [8, 1, 128]
