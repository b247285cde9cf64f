"""The sim engine with prefix caching: a second prompt sharing a prefix is charged its suffix only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.worker.engines import sim
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.sequence import Sequence


class _Tokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def _seq(rid: str, prompt: list[int], phase: str = "mixed") -> Sequence:
    request = GenerateRequest(rid, "m", prompt, SamplingParams(max_tokens=4), "api", 0)
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
