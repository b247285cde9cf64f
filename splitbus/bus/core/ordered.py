"""An ordered writer: entries buffered in order and written, in one round trip, by one script.

What a worker's result writer stands on (``splitbus.bus.results``): many coroutines' entries go
out together, each entry once, in the order it was buffered. Each flush round runs the script
once per group of entries whose keys share a hash slot (a script's keys must: on a cluster it
runs where that slot lives), at most ``chunk`` entries a run (bounds how long one run holds
Redis), every run in one pipeline, or alone when there is one. An entry leaves the buffer only
once its run succeeded: what failed (Redis away) is kept, in order, ahead of what was buffered
meanwhile, so the next flush writes it again. A script Redis lost (a restart, a failover) is
loaded again once per flush. The script is declared by the protocol that owns its keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError
from redis.typing import EncodableT

from splitbus.bus.core.scripts import LuaScript

Item = TypeVar("Item")
"""What the owner buffers: one entry and what it needs to write it (distinct objects: an item is
told apart from an equal one by its identity)."""
ScriptArgs = tuple[list[str], list[EncodableT]]
"""One run's KEYS and ARGV."""

CHUNK = 1000
"""Entries per script run: bounds how long one run holds Redis (~1 ms)."""


class OrderedWriter(Generic[Item]):
    """Writes buffered items in order with ``script``, grouped by ``slot_of`` (items that may
    share a run); ``args_of`` makes a run's KEYS and ARGV from its items, and ``written`` is told
    the items of each round that were written, in order."""

    def __init__(
        self,
        redis: aioredis.Redis,
        script: LuaScript,
        slot_of: Callable[[Item], str],
        args_of: Callable[[list[Item]], ScriptArgs],
        written: Callable[[list[Item]], None],
        chunk: int = CHUNK,
    ) -> None:
        self._redis = redis
        self._script = script
        self._registered = script.register(redis)
        self._slot_of, self._args_of, self._written = slot_of, args_of, written
        self._chunk = chunk
        self._buffer: list[Item] = []
        self.scripts = 0
        """Script runs sent so far (one per slot group and chunk per round)."""

    @property
    def sha(self) -> str:
        return self._registered.sha

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def add(self, item: Item) -> None:
        self._buffer.append(item)

    def add_first(self, items: list[Item]) -> None:
        """Put ``items`` ahead of everything buffered (what must be written again first)."""
        self._buffer = items + self._buffer

    def drop(self, unwanted: Callable[[Item], bool]) -> None:
        """Take the unwanted items out of the buffer, unwritten."""
        self._buffer = [item for item in self._buffer if not unwanted(item)]

    def holds(self, wanted: Callable[[Item], bool]) -> bool:
        return any(wanted(item) for item in self._buffer)

    async def flush(self) -> None:
        """Write everything buffered, round after round (what is buffered during a round goes in
        the next). Raises the first error of a round that failed for another reason than a lost
        script (what failed stays buffered)."""
        loaded = False
        while self._buffer:
            errors = await self._round()
            if errors and not loaded and all(isinstance(e, NoScriptError) for e in errors):
                await self._redis.script_load(self._script.source)
                loaded = True
            elif errors:
                raise errors[0]

    async def _round(self) -> list[BaseException]:
        pending = self._buffer[:]
        runs = self._runs(pending)
        replies = await self._send(pending, runs)
        failed = {id(pending[i]) for run, error in zip(runs, replies, strict=True) if error for i in run}
        self._written([item for item in pending if id(item) not in failed])
        self._requeue(pending, failed)
        return [reply for reply in replies if reply is not None]

    def _requeue(self, sent: list[Item], failed: set[int]) -> None:
        """Keep what failed, in order, ahead of what was buffered during the write (unless it was
        dropped meanwhile)."""
        held, tried = {id(item) for item in self._buffer}, {id(item) for item in sent}
        again = [item for item in sent if id(item) in failed and id(item) in held]
        self._buffer = again + [item for item in self._buffer if id(item) not in tried]

    def _runs(self, pending: list[Item]) -> list[list[int]]:
        """The buffer's indexes, grouped by slot (each group keeps its order), at most ``chunk``
        to a run."""
        by_slot: dict[str, list[int]] = {}
        for i, item in enumerate(pending):
            by_slot.setdefault(self._slot_of(item), []).append(i)
        return [ids[at : at + self._chunk] for ids in by_slot.values() for at in range(0, len(ids), self._chunk)]

    async def _send(self, pending: list[Item], runs: list[list[int]]) -> list[BaseException | None]:
        """Run the script once per run, in one pipeline; None for each that ran, else its error
        (an exception is always true)."""
        self.scripts += len(runs)
        if len(runs) == 1:  # the common round (one slot): no pipeline to build and parse
            return [await self._run(*self._args_of([pending[i] for i in runs[0]]))]
        pipe = self._redis.pipeline(transaction=False)
        for run in runs:
            keys, args = self._args_of([pending[i] for i in run])
            pipe.evalsha(self.sha, len(keys), *keys, *args)  # on a cluster, routed by its keys
        replies = await pipe.execute(raise_on_error=False)
        return [reply if isinstance(reply, BaseException) else None for reply in replies]

    async def _run(self, keys: list[str], args: list[EncodableT]) -> NoScriptError | None:
        try:
            await self._redis.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError as exc:
            return exc
        return None
