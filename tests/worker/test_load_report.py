"""What a worker tells schedulers about its queue, against a real Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.bus.registry import Registry
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.sequence import Sequence
from splitbus.worker.table import Status
from splitbus.worker.text import TextStream
from splitbus.worker.worker import Worker


async def test_a_prefill_batch_stops_counting_as_queued_while_it_runs(bus_config: BusConfig, tiny_model: Path) -> None:
    # Schedulers place new work by queued prefill tokens while the batch runs: counted as
    # queued, it steered new work away from this worker until its next report.
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(
        bus=bus_config,
        role="mixed",
        model_dir=tiny_model,
        model_name="tiny",
        worker_id="m1",
        max_prefill_tokens=300,
    )
    worker = Worker(config, tokenizer, SimEngine(SimConfig(prefill_s_per_token=0.002), tokenizer, 64, 16))
    registry = Registry(worker.redis, bus_config)
    for i, tokens in enumerate((200, 100, 150)):  # the first two fit one batch, the third waits
        request = GenerateRequest(f"r{i}", "tiny", [97 + i] * tokens, SamplingParams(max_tokens=4), "api", 0)
        worker.requests.add(Sequence(Task("mixed", request), f"{i}-0", TextStream(tokenizer, [])), Status.QUEUED)
        worker.writer.open(request.request_id, reader=request.reader, first_seq=0)
    try:
        await registry.register(worker.record(), lease_ms=5000)
        prefill = asyncio.create_task(worker.steps.prefill_queued())  # 300 tokens: 0.6 s
        await asyncio.sleep(0.2)
        (info,) = await registry.snapshot()
        assert not prefill.done() and info.record.load.queued_prefill_tokens == 150
        await prefill
    finally:
        await worker.redis.aclose()
