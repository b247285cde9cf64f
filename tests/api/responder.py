"""A scripted stand-in for scheduler + workers, for API tests only (not product code).

It registers as a live worker, consumes ``sb:requests`` in the schedulers' group and answers
each request with a known text, one token per step. Prompts steer it:

- ``[fail:STATUS]`` -> an error entry with that status before any token, whose message names
  this worker and an exception, as real workers' messages do (``failure_detail``)
- ``[slow]`` -> 50 ms between tokens (for disconnect tests)
- ``[silent]`` -> no answer at all (for timeout tests)
- ``[say]TEXT[/say]`` -> TEXT (up to ``max_tokens`` characters) instead of the known text, then
  ``stop`` (a model's tool calls, for the parsers' tests)

Its usage reports half of every prompt as cached (``cached_tokens``), as a prefix cache would.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from typing import Any

from splitbus.bus.cancel import CancelListener
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import TRANSIENT_ERRORS, connect
from splitbus.bus.core.keys import SCHEDULER_GROUP
from splitbus.bus.core.streams import GroupConsumer
from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.bus.results import ResultWriter
from splitbus.tokenization import ModelTokenizer

REPLY = "The quick brown fox jumps over the lazy dog. "


def expected_text(max_tokens: int, stop: list[str] | None = None) -> tuple[str, str]:
    """What the responder answers (byte-level tokenizer: one ASCII char per token)."""
    text = (REPLY * (max_tokens // len(REPLY) + 1))[:max_tokens]
    for s in stop or []:
        if s in text:
            return text[: text.index(s)], "stop"
    return text, "length"


def failure_detail(worker_id: str) -> str:
    """The message of a scripted error entry: internal detail no client may read."""
    return f"worker {worker_id} could not handle this request's task: RuntimeError: CUDA error 700 at 0x7f3a"


class Responder:
    def __init__(self, config: BusConfig, tokenizer: ModelTokenizer, model: str = "tiny") -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model = model
        self.worker_id = f"responder-{os.getpid()}-{id(self)}"  # role-host-pid, as a real worker's id reads
        self.cancelled: list[str] = []
        self.served: list[str] = []
        self.requests: list[GenerateRequest] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stop = asyncio.Event()

    def start(self) -> Responder:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._main(), self._loop)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=0.1)

    async def _main(self) -> None:
        redis = connect(self.config)
        registry = Registry(redis, self.config)
        consumer = GroupConsumer(redis, self.config, self.config.keys.requests, SCHEDULER_GROUP, "responder")
        await consumer.ensure_group()
        await registry.register(WorkerRecord(worker_id=self.worker_id, role="mixed", model=self.model), 2000)
        cancels = CancelListener(redis, self.config)
        await cancels.start()
        tasks = [self._heartbeat(registry), self._consume(redis, consumer), self._listen(cancels)]
        await asyncio.gather(*(self._forever(t) for t in tasks))

    async def _forever(self, coro: Any) -> None:
        try:
            await coro
        except TRANSIENT_ERRORS:
            pass

    async def _heartbeat(self, registry: Registry) -> None:
        record = WorkerRecord(worker_id=self.worker_id, role="mixed", model=self.model)
        while not self._stop.is_set():
            try:
                await registry.register(record, 2000)
            except TRANSIENT_ERRORS:
                pass
            await asyncio.sleep(0.3)

    async def _listen(self, cancels: CancelListener) -> None:
        while not self._stop.is_set():
            try:
                self.cancelled += [c.request_id for c in await cancels.poll(block_ms=100)]
            except TRANSIENT_ERRORS:
                await asyncio.sleep(0.1)

    async def _consume(self, redis: Any, consumer: GroupConsumer) -> None:
        while not self._stop.is_set():
            try:
                batch = await consumer.read(64, block_ms=100)
            except TRANSIENT_ERRORS:
                await asyncio.sleep(0.1)
                continue
            for delivery in batch:
                asyncio.ensure_future(self._answer(redis, delivery.message))
            if batch:
                await consumer.ack(*[d.entry_id for d in batch])

    async def _answer(self, redis: Any, request: GenerateRequest) -> None:
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        self.served.append(request.request_id)
        self.requests.append(request)
        writer = ResultWriter(redis, self.config)
        if "[silent]" in prompt:
            return
        failure = re.search(r"\[fail:(\d+)\]", prompt)
        if failure:
            detail = failure_detail(self.worker_id)
            writer.fail(request.request_id, "scripted", detail, int(failure.group(1)), reader=request.reader)
            await writer.flush()
            return
        said = re.search(r"\[say\](.*?)\[/say\]", prompt, re.S)
        scripted = (said.group(1)[: request.sampling.max_tokens], "stop") if said else None
        await self._stream(writer, request, delay=0.05 if "[slow]" in prompt else 0.0, scripted=scripted)

    async def _stream(
        self, writer: ResultWriter, request: GenerateRequest, delay: float, scripted: tuple[str, str] | None = None
    ) -> None:
        text, reason = scripted or expected_text(request.sampling.max_tokens, request.sampling.stop)
        rid = request.request_id
        writer.open(rid, reader=request.reader)
        for char in text:
            if rid in self.cancelled:
                return
            writer.tokens(rid, self.tokenizer.encode(char), char)
            await writer.flush()
            await asyncio.sleep(delay)
        prompt = len(request.prompt_token_ids)
        writer.finish(rid, reason, prompt, len(text), cached_tokens=prompt // 2)
        await writer.flush()
