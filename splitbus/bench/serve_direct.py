"""The sim engine driven in-process the way a worker drives it (continuous batching: take what
there is room for, prefill what is queued, decode what runs, detokenize every token), with no
HTTP, bus or scheduler: the baseline ``splitbus bench serve`` compares the whole stack with."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from splitbus import aio
from splitbus.bench.serve_trace import RequestResult, ServeConfig, TraceItem, cdf_samples, replay, summarize
from splitbus.bench.workloads import ideal_for, make_items
from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.bus.roles import Phase, Role
from splitbus.tokenization import ModelTokenizer
from splitbus.worker import engines
from splitbus.worker.config import WorkerConfig
from splitbus.worker.sequence import Sequence
from splitbus.worker.text import TextStream


class _Pending:
    def __init__(self, seq: Sequence, result: RequestResult) -> None:
        self.seq, self.result = seq, result
        self.sent = self.last = time.perf_counter()
        self.done = asyncio.get_running_loop().create_future()


class DirectLoop:
    """One worker's engine loop without the bus, with a worker's capacities and engine costs."""

    def __init__(self, tokenizer: ModelTokenizer, config: WorkerConfig) -> None:
        self.tokenizer = tokenizer
        self.max_requests = config.max_requests
        self.max_prefill_tokens = config.max_prefill_tokens
        setup = engines.EngineSetup(config.model_dir, tokenizer, block_size=config.block_size)
        self.engine = engines.create("sim", setup)  # as the worker CLI builds it, with its defaults
        self.waiting: deque[_Pending] = deque()  # not admitted: no room yet
        self.queued: deque[_Pending] = deque()
        self.running: list[_Pending] = []
        self.wake = asyncio.Event()

    async def send(self, item: TraceItem) -> RequestResult:
        request = GenerateRequest(
            uuid.uuid4().hex,
            self.tokenizer.name,
            item.prompt_token_ids,
            SamplingParams(max_tokens=item.max_tokens, ignore_eos=True),
            "direct",
            0,
        )
        pending = _Pending(
            Sequence(Task(Phase.MIXED, request), "", TextStream(self.tokenizer, [])),
            RequestResult(ok=False, prompt_tokens=len(item.prompt_token_ids)),
        )
        self.waiting.append(pending)
        self.wake.set()
        return await pending.done

    async def run(self) -> None:
        while True:
            await self.wait_for_work()
            await self.prefill_queued()
            await self.decode_running()

    async def wait_for_work(self) -> None:
        while self.waiting and len(self.queued) + len(self.running) < self.max_requests:
            pending = self.waiting.popleft()
            self.engine.reserve(pending.seq, pending.seq.prompt_len + pending.seq.request.sampling.max_tokens)
            self.queued.append(pending)
        if not self.queued and not self.running:
            self.wake.clear()
            await self.wake.wait()

    async def prefill_queued(self) -> None:
        batch: list[_Pending] = []
        tokens = 0
        while self.queued and (not batch or tokens + self.queued[0].seq.prompt_len <= self.max_prefill_tokens):
            batch.append(self.queued.popleft())
            tokens += batch[-1].seq.prompt_len
        if batch:
            for pending, token in zip(batch, await self.engine.prefill([p.seq for p in batch]), strict=True):
                self.emit(pending, token)
            self.running += [p for p in batch if not p.done.done()]

    async def decode_running(self) -> None:
        if self.running:
            running = list(self.running)
            for pending, token in zip(running, await self.engine.decode([p.seq for p in running]), strict=True):
                self.emit(pending, token)
            self.running = [p for p in self.running if not p.done.done()]

    def emit(self, pending: _Pending, token: int) -> None:
        pending.seq.add_token(token, self.engine.eos_token_ids)
        now, result = time.perf_counter(), pending.result
        if result.output_tokens == 0:
            result.ttft_s = now - pending.sent
        else:
            result.itl_s.append(now - pending.last)
        pending.last = now
        result.output_tokens += 1
        if pending.seq.finish_reason:
            result.e2el_s, result.ok = now - pending.sent, True
            self.engine.release(pending.seq)
            pending.done.set_result(result)


def measure_direct(model_dir: Path, config: ServeConfig, rate: float) -> tuple[dict[str, Any], dict[str, list[float]]]:
    async def main() -> tuple[list[RequestResult], float]:
        worker = WorkerConfig(
            bus=BusConfig(), role=Role.MIXED, model_dir=model_dir, model_name=config.model
        )  # the defaults `up` uses
        loop = DirectLoop(ModelTokenizer.load(model_dir, config.model), worker)
        engine = asyncio.create_task(loop.run())
        try:
            return await replay(loop.send, items, config.max_concurrency)
        finally:
            engine.cancel()

    items = make_items(config, rate)
    # On the event loop a worker runs on: its timers decide how long the sim engine's sleeps last.
    results, duration = aio.run(main())
    summary = summarize(results, duration, dict(config.goodput))
    return {**summary, "ideal_prefix_hit_ratio": ideal_for(config, items)}, cdf_samples(results)
