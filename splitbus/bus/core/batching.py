"""Redis commands from many coroutines, sent together: one pipeline per event-loop turn.

At low load a command goes out at the next turn of the loop, alone (no added wait), or, awaited
with ``run``, at once from its caller's task. Under load, commands queued while a pipeline (or a
``run``'s command) is in flight go out together in the next one, so N concurrent requests cost
one round trip instead of N.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis

log = logging.getLogger(__name__)
MAX_BATCH = 1000


class Batcher:
    def __init__(self, redis: aioredis.Redis, max_batch: int = MAX_BATCH) -> None:
        self._redis = redis
        self._max_batch = max_batch
        self._queue: list[tuple[str, tuple[Any, ...], dict[str, Any], asyncio.Future[Any]]] = []
        self._flushing = False
        self.pipelines = 0
        """Pipelines sent so far (a benchmark's measure of how much was batched)."""

    def call(self, command: str, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """Queue one command (a redis-py method name and its arguments); the future gets its
        reply, or the error that the command or the pipeline raised. ``"evalsha"`` (sha,
        numkeys, keys..., args...) works on a cluster client too; a NOSCRIPT comes back as
        the future's NoScriptError, for the caller to load the script (``AsyncScript``) and run
        it again."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((command, args, kwargs, future))
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())
        return future

    async def run(self, command: str, *args: Any, **kwargs: Any) -> Any:
        """``call``'s reply, awaited. With nothing in flight the command goes out at once from the
        caller's own task, as a command, not a pipeline of one: no task started for it, no turn
        of the loop before it leaves, none of a pipeline's bookkeeping (on an idle API this cut
        the request's write to the scheduler's read: docs/benchmarks.md, "Each hop, to the
        microsecond"). What is called meanwhile queues and goes out together once it is back,
        as with ``call``."""
        if self._flushing:
            return await self.call(command, *args, **kwargs)
        self._flushing = True
        try:
            return await getattr(self._redis, command)(*args, **kwargs)
        finally:
            self._queued_meanwhile()

    def _queued_meanwhile(self) -> None:
        """After ``run``'s own command: flush what queued while it was in flight, if anything."""
        if self._queue:
            asyncio.get_running_loop().create_task(self._flush())
        else:
            self._flushing = False

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
                await self._send(batch)
        finally:
            self._flushing = False

    async def _send(self, batch: list[tuple[str, tuple[Any, ...], dict[str, Any], asyncio.Future[Any]]]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for command, args, kwargs, _ in batch:
            getattr(pipe, command)(*args, **kwargs)  # a cluster pipeline routes each, scripts by their keys
        self.pipelines += 1
        try:
            replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the connection failed: every command in it failed
            replies = [exc] * len(batch)
        for (_, _, _, future), reply in zip(batch, replies, strict=False):
            if future.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(reply, BaseException):
                future.set_exception(reply)
            else:
                future.set_result(reply)
