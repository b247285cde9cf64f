"""Everything an API process holds, created in the app's lifespan (no module globals)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Coroutine

from splitbus.api import metrics
from splitbus.api.config import ApiConfig
from splitbus.api.errors import ModelNotFound, ServiceUnavailable, TooManyRequests
from splitbus.bus.aio import cancel_and_wait
from splitbus.bus.cancel import publish_cancel
from splitbus.bus.connection import TRANSIENT_ERRORS, connect
from splitbus.bus.registry import Registry, RegistryView
from splitbus.bus.results import ResultReader
from splitbus.bus.streams import Producer
from splitbus.tokenization import ModelTokenizer

log = logging.getLogger(__name__)


class ApiState:
    def __init__(self, config: ApiConfig, tokenizers: dict[str, ModelTokenizer]) -> None:
        self.config = config
        self.tokenizers = tokenizers
        self.redis = connect(config.bus, max_connections=config.redis_connections, name=config.node_id)
        self.reader = ResultReader(config.bus, self.redis, name=f"{config.node_id}.out", shards=config.reader_shards)
        self.producer = Producer(self.redis, config.bus, batched=True)  # concurrent requests share XADD pipelines
        self.workers = RegistryView(Registry(self.redis, config.bus), config.registry_refresh_s)
        self.inflight = 0
        self.backlog = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    @classmethod
    async def open(cls, config: ApiConfig) -> "ApiState":
        tokenizers = {name: ModelTokenizer.load(folder, name) for name, folder in config.models}
        state = cls(config, tokenizers)
        await state.reader.start()
        await state.workers.refresh()
        state.spawn(state.workers.run())
        state.spawn(state.watch_backlog())
        return state

    async def watch_backlog(self) -> None:
        """The request stream's length, read at the registry's pace (never per request)."""
        while not self.workers.stopped:
            with contextlib.suppress(*TRANSIENT_ERRORS):
                self.backlog = int(await self.redis.xlen(self.config.bus.keys.requests))
            await asyncio.sleep(self.config.registry_refresh_s)

    async def close(self) -> None:
        self.workers.stop()
        await self.reader.close()
        await cancel_and_wait(self._tasks)
        await self.redis.aclose()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run in the background, kept referenced until done (cancellations outlive the
        handler that a client disconnect cancelled)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def tokenizer(self, model: str) -> ModelTokenizer:
        try:
            return self.tokenizers[model]
        except KeyError:
            raise ModelNotFound(f"The model '{model}' does not exist", "model") from None

    def admit(self, model: str) -> None:
        """Take an in-flight slot, or say why not (429 over the bound, 503 nobody to serve)."""
        if self.inflight >= self.config.max_inflight:
            raise TooManyRequests(f"more than {self.config.max_inflight} requests in flight; retry later")
        if self.backlog >= self.config.max_backlog:
            raise TooManyRequests(f"the request queue holds {self.backlog} entries (bound {self.config.max_backlog}); retry later")
        if not self.workers.redis_ok:
            raise ServiceUnavailable("Redis is unreachable")
        if not self.workers.serves(model):
            raise ServiceUnavailable(f"no live worker serves model '{model}'")
        self.inflight += 1
        metrics.INFLIGHT.set(self.inflight)

    def release(self) -> None:
        self.inflight -= 1
        metrics.INFLIGHT.set(self.inflight)

    def cancel_later(self, request_id: str, reason: str) -> None:
        metrics.CANCELLATIONS.labels(reason).inc()
        self.spawn(self._cancel(request_id, reason))

    async def _cancel(self, request_id: str, reason: str) -> None:
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await publish_cancel(self.redis, self.config.bus, request_id, reason)
