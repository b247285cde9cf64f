"""The sim engine driven in-process the way a worker drives it (continuous batching: take what
there is room for, prefill what is queued, decode what runs, detokenize every token), with no
HTTP, bus or scheduler: the baseline ``splitbus bench serve`` compares the whole stack with."""

from __future__ import annotations

import asyncio
import logging
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

log = logging.getLogger("splitbus.bench.serve_direct")


class Pending:
    """A request in the engine loop: its sequence, and what each of its tokens is given to."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.cancelled = False

    def token(self, text: str) -> None:
        """One generated token's text; ``seq.finish_reason`` is set on the last."""
        raise NotImplementedError

    def fail(self, message: str) -> None:
        """The request ends without its tokens: the engine loop stopped (``message`` says how)."""
        if not self.done.done():
            self.done.set_result(None)


class _Timed(Pending):
    """A request of the in-process run: each token timed as the benchmark's HTTP client times it."""

    def __init__(self, seq: Sequence, result: RequestResult) -> None:
        super().__init__(seq)
        self.result = result
        self.sent = self.last = time.perf_counter()

    def token(self, text: str) -> None:
        now, result = time.perf_counter(), self.result
        if result.output_tokens == 0:
            result.ttft_s = now - self.sent
        else:
            result.itl_s.append(now - self.last)
        self.last = now
        result.output_tokens += 1
        if self.seq.finish_reason:
            result.e2el_s, result.ok = now - self.sent, True
            result.cached_tokens = self.seq.prompt_cached  # as a worker reports it in the usage

    def fail(self, message: str) -> None:
        self.result.error = message
        super().fail(message)


def new_sequence(tokenizer: ModelTokenizer, prompt: list[int], max_tokens: int) -> Sequence:
    """A mixed task's sequence for ``prompt``, greedy to ``max_tokens`` (EOS ignored), as a
    worker holds it."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = GenerateRequest(uuid.uuid4().hex, tokenizer.name, prompt, sampling, "direct", 0)
    return Sequence(Task(Phase.MIXED, request), "", TextStream(tokenizer, []))


class DirectLoop:
    """One worker's engine loop without the bus, with a worker's capacities and engine costs.

    Its engine is built as ``splitbus up --engine sim`` builds its worker's, with the same cache
    settings: the prefix cache on, the worker's default block size (16 tokens) and the sim
    engine's default KV blocks (8,192), so a prompt finds what the stack's worker would find."""

    def __init__(self, tokenizer: ModelTokenizer, config: WorkerConfig) -> None:
        self.tokenizer = tokenizer
        self.max_requests = config.max_requests
        self.max_prefill_tokens = config.max_prefill_tokens
        self.block_size = config.block_size
        setup = engines.EngineSetup(config.model_dir, tokenizer, block_size=config.block_size)
        self.engine = engines.create("sim", setup)  # as the worker CLI builds it, with its defaults
        self.waiting: deque[Pending] = deque()  # not admitted: no room yet
        self.queued: deque[Pending] = deque()
        self.running: list[Pending] = []
        self.live: set[Pending] = set()  # submitted and not done: what fails if the loop stops
        self.stopped = ""  # why the engine loop ended by an error ("": it runs)
        self.wake = asyncio.Event()

    @classmethod
    def load(cls, model_dir: Path, model: str) -> DirectLoop:
        """The loop over the model in ``model_dir``, served as ``model``, with the worker
        settings ``up`` gives a mixed worker (its defaults)."""
        worker = WorkerConfig(bus=BusConfig(), role=Role.MIXED, model_dir=model_dir, model_name=model)
        return cls(ModelTokenizer.load(model_dir, model), worker)

    @property
    def kv_tokens(self) -> int:
        """The positions the whole KV pool holds: a request that needs more can never be served."""
        return self.engine.total_blocks * self.block_size

    @staticmethod
    def need(seq: Sequence) -> int:
        """The positions a request reserves: its prompt and all it may generate."""
        return seq.prompt_len + seq.request.sampling.max_tokens

    def refusal(self, seq: Sequence) -> str:
        """Why the loop can never serve the request ("": it can): the engine loop stopped, or the
        request does not fit the whole KV pool (it would wait first in line forever)."""
        if not self.stopped and self.need(seq) > self.kv_tokens:
            return f"{self.need(seq)} tokens never fit the {self.kv_tokens} of the KV pool"
        return self.stopped

    def submit(self, pending: Pending) -> None:
        """Queue a request; its tokens go to ``pending.token``, and ``pending.done`` is set after the
        last (or when it fails: the loop stopped)."""
        if refused := self.refusal(pending.seq):
            pending.fail(refused)
            return
        self.live.add(pending)
        pending.done.add_done_callback(lambda _: self.live.discard(pending))
        self.waiting.append(pending)
        self.wake.set()

    def start(self) -> asyncio.Task[None]:
        """The engine loop as a task. If it ends by an error, the error is logged and every request
        in it fails (none waits for tokens that will not come), as does any submitted later."""
        task = asyncio.create_task(self.run())
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("the sim engine's loop stopped", exc_info=task.exception())
        self.stopped = f"the engine loop stopped: {task.exception()!r}"
        for pending in list(self.live):
            pending.fail(self.stopped)

    def cancel(self, pending: Pending) -> None:
        """Drop a request whose client left: at once where it waits (its blocks released if it
        holds any); one in the engine's step now leaves at its next token. Finished: nothing."""
        if pending.done.done():
            return
        pending.cancelled = True
        if pending in self.waiting:
            self.waiting.remove(pending)
            pending.done.set_result(None)
        elif pending in self.queued:
            self.queued.remove(pending)
            self.finish(pending)

    async def send(self, item: TraceItem) -> RequestResult:
        seq = new_sequence(self.tokenizer, item.prompt_token_ids, item.max_tokens)
        pending = _Timed(seq, RequestResult(ok=False, prompt_tokens=len(item.prompt_token_ids)))
        self.submit(pending)
        await pending.done
        return pending.result

    async def run(self) -> None:
        """Step forever (until cancelled); see ``start``."""
        while True:
            await self.wait_for_work()
            await self.prefill_queued()
            await self.decode_running()

    async def wait_for_work(self) -> None:
        """Admit what has room: a request whose blocks are not free yet waits, first in line, until
        a request leaves (as a worker leaves a decode task unread: ``kv_room_for``)."""
        while self.waiting and len(self.queued) + len(self.running) < self.max_requests:
            seq = self.waiting[0].seq
            if not self.engine.reserve(seq, self.need(seq)):
                break
            self.queued.append(self.waiting.popleft())
        if not self.queued and not self.running:
            self.wake.clear()
            await self.wake.wait()

    async def prefill_queued(self) -> None:
        batch: list[Pending] = []
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

    def emit(self, pending: Pending, token: int) -> None:
        if pending.cancelled:  # its client left during the step: it takes no token, and leaves
            self.finish(pending)
            return
        pending.token(pending.seq.add_token(token, self.engine.eos_token_ids))
        if pending.seq.finish_reason:
            self.finish(pending)

    def finish(self, pending: Pending) -> None:
        self.engine.release(pending.seq)
        pending.done.set_result(None)


def measure_direct(model_dir: Path, config: ServeConfig, rate: float) -> tuple[dict[str, Any], dict[str, list[float]]]:
    async def main() -> tuple[list[RequestResult], float]:
        loop = DirectLoop.load(model_dir, config.model)
        engine = loop.start()
        try:
            return await replay(loop.send, items, config.max_concurrency)
        finally:
            engine.cancel()

    items = make_items(config, rate)
    # On the event loop a worker runs on: its timers decide how long the sim engine's sleeps last.
    results, duration = aio.run(main())
    summary = summarize(results, duration, dict(config.goodput))
    return {**summary, "ideal_prefix_hit_ratio": ideal_for(config, items)}, cdf_samples(results)
