"""The sim engine with prefix caching: a second prompt sharing a prefix is charged its suffix only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from splitbus.bus.blocks import chain_hex, split_hex
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.bus.messages.kv_events import BlockStored
from splitbus.worker.engines import sim
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.sequence import Sequence


class _Tokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def _seq(rid: str, prompt: list[int], phase: str = "mixed", salt: str = "") -> Sequence:
    request = GenerateRequest(rid, "m", prompt, SamplingParams(max_tokens=4), "api", 0, cache_salt=salt)
    return Sequence(Task(phase, request, peer="" if phase == "mixed" else "x"), "0-0", None)  # type: ignore[arg-type]  # no text needed


def _run(engine: SimEngine, seq: Sequence, slept: list[float]) -> None:
    assert engine.reserve(seq, seq.prompt_len + 4)
    slept.clear()
    seq.output_ids.append(asyncio.run(engine.prefill([seq]))[0])
    prefill_s = slept[0]
    seq.output_ids.append(asyncio.run(engine.decode([seq]))[0])
    engine.release(seq)
    slept[:] = [prefill_s]


def test_the_second_request_is_charged_only_its_uncached_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def record(seconds: float, *_: Any) -> None:
        slept.append(seconds)

    monkeypatch.setattr(sim.asyncio, "sleep", record)
    engine = SimEngine(SimConfig(prefill_s_per_token=1.0), _Tokenizer(), total_blocks=64, block_size=16)  # type: ignore[arg-type]  # encode only
    shared = list(range(100))
    _run(engine, _seq("a", shared + [1, 2]), slept)
    assert slept == [102.0]
    second = _seq("b", shared + [3, 4, 5])
    _run(engine, second, slept)
    assert second.prompt_cached == 96 and slept == [103.0 - 96]
    assert engine.free_blocks == 64


def test_a_decode_task_takes_no_cached_blocks() -> None:
    engine = SimEngine(SimConfig(), _Tokenizer(), total_blocks=64, block_size=16)  # type: ignore[arg-type]  # encode only
    first = _seq("a", list(range(40)))
    assert engine.reserve(first, 44)
    asyncio.run(engine.prefill([first]))
    engine.release(first)
    decode = _seq("b", list(range(40)), phase="decode")
    assert engine.reserve(decode, 44) and decode.prompt_cached == 0


def test_a_prompt_reuses_only_the_blocks_of_its_own_salt() -> None:
    """Each request's chain starts at its salt: the same prompt under another salt (another
    tenant's, or another cache_salt) or none finds nothing, and the events name the salted
    chain the API sent for routing (``chain_hex`` with the salt)."""
    engine = SimEngine(SimConfig(), _Tokenizer(), total_blocks=64, block_size=16)  # type: ignore[arg-type]  # encode only
    prompt, salt = list(range(70)), "5a" * 16
    first = _seq("a", prompt, salt=salt)
    assert engine.reserve(first, 74)
    asyncio.run(engine.prefill([first]))
    engine.release(first)
    stored = [h for e in engine.kv_events.pending() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored[:4] == split_hex(chain_hex(prompt, 16, salt=salt))
    for rid, other in (("plain", ""), ("other", "a5" * 16)):
        seq = _seq(rid, prompt, salt=other)
        assert engine.cached_prefix(seq.task) == 0
        assert engine.reserve(seq, 74) and seq.prompt_cached == 0
        engine.release(seq)
    again = _seq("b", prompt, salt=salt)
    assert engine.cached_prefix(again.task) == 64
    assert engine.reserve(again, 74) and again.prompt_cached == 64
