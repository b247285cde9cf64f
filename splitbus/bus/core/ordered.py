"""An ordered writer: entries buffered in order and written, in one round trip, by one script.

What a worker's result writer stands on (``splitbus.bus.results``): many coroutines' entries go
out together, each entry once, in the order it was buffered. Each round runs the script once per
group of entries whose keys share a hash slot (a script's keys must: on a cluster it runs where
that slot lives), at most ``chunk`` entries a run (bounds how long one run holds Redis), every run
in one pipeline, or alone when there is one. An entry leaves the buffer only once its run
succeeded: what failed (Redis away) is kept, in order, ahead of what was buffered meanwhile, so
the next round writes it again. The script is declared by the protocol that owns its keys.

The owner drives the rounds, and the writer calls nothing of the owner's: each entry comes with
its slot and the owner's name for it (what ``drop`` and ``holds`` look for: a request id); a round
is ``runs()`` (the entries, grouped), the owner's KEYS and ARGV for each run, then ``write``, which
answers what was written and what failed. So a flush reads top to bottom in the owner's module
(``ResultWriter.flush``), and no call comes back into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError
from redis.typing import EncodableT

from splitbus.bus.core.scripts import LuaScript

Item = TypeVar("Item")
"""What the owner buffers: one entry and what it needs to write it."""
ScriptArgs = tuple[list[str], list[EncodableT]]
"""One run's KEYS and ARGV."""

CHUNK = 1000
"""Entries per script run: bounds how long one run holds Redis (~1 ms)."""


@dataclass(frozen=True)
class Round(Generic[Item]):
    """What one ``write`` did: the items written, in the order they were buffered, and each
    failed run's error."""

    written: list[Item]
    errors: list[BaseException] = field(default_factory=list)

    @property
    def lost_script(self) -> bool:
        """Every failed run failed because Redis lost the script (a restart, a failover): the
        cure is ``reload`` and another round."""
        return bool(self.errors) and all(isinstance(e, NoScriptError) for e in self.errors)


@dataclass(eq=False, slots=True)
class _Entry(Generic[Item]):
    """A buffered item with its slot and its owner's name for it (told apart by identity)."""

    slot: str
    owner: str
    item: Item


class OrderedWriter(Generic[Item]):
    """Buffers items in order and writes them with ``script``, one run per slot group and
    ``chunk`` items, in rounds the owner drives: ``runs``, then ``write``."""

    def __init__(self, redis: aioredis.Redis, script: LuaScript, chunk: int = CHUNK) -> None:
        self._redis = redis
        self._script = script
        self._registered = script.register(redis)
        self._chunk = chunk
        self._buffer: list[_Entry[Item]] = []
        self._sent: list[_Entry[Item]] = []  # the round ``runs`` began: its entries in buffer order
        self._runs: list[list[_Entry[Item]]] = []  # and the same entries grouped into runs
        self.scripts = 0
        """Script runs sent so far (one per slot group and chunk per round)."""

    @property
    def sha(self) -> str:
        return self._registered.sha

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def add(self, slot: str, owner: str, item: Item) -> None:
        self._buffer.append(_Entry(slot, owner, item))

    def add_first(self, items: list[tuple[str, str, Item]]) -> None:
        """Put ``items`` (slot, owner, item) ahead of everything buffered (what must be written
        again first)."""
        self._buffer = [_Entry(*item) for item in items] + self._buffer

    def drop(self, owner: str) -> None:
        """Take the owner's items out of the buffer, unwritten."""
        self._buffer = [entry for entry in self._buffer if entry.owner != owner]

    def holds(self, owner: str) -> bool:
        return any(entry.owner == owner for entry in self._buffer)

    def runs(self) -> list[list[Item]]:
        """Begin a round with everything buffered now: its items grouped by slot (each group in
        order), at most ``chunk`` to a run. What is buffered from here on goes in the next round."""
        self._sent = self._buffer[:]
        by_slot: dict[str, list[_Entry[Item]]] = {}
        for entry in self._sent:
            by_slot.setdefault(entry.slot, []).append(entry)
        chunk = self._chunk
        self._runs = [group[at : at + chunk] for group in by_slot.values() for at in range(0, len(group), chunk)]
        return [[entry.item for entry in run] for run in self._runs]

    async def write(self, args: list[ScriptArgs]) -> Round[Item]:
        """Run the script once per run of the round ``runs`` began, with each run's KEYS and ARGV
        (in the order ``runs`` gave them), in one pipeline. What failed stays buffered, ahead of
        what was buffered meanwhile."""
        sent, runs = self._sent, self._runs
        self._sent, self._runs = [], []
        replies = await self._send(args)
        failed = {id(entry) for run, error in zip(runs, replies, strict=True) if error for entry in run}
        self._requeue(sent, failed)
        written = [entry.item for entry in sent if id(entry) not in failed]
        return Round(written, [reply for reply in replies if reply is not None])

    async def reload(self) -> None:
        """Load the script again (Redis lost it: ``Round.lost_script``)."""
        await self._redis.script_load(self._script.source)

    def _requeue(self, sent: list[_Entry[Item]], failed: set[int]) -> None:
        """Keep what failed, in order, ahead of what was buffered during the write (unless it was
        dropped meanwhile)."""
        held, tried = {id(entry) for entry in self._buffer}, {id(entry) for entry in sent}
        again = [entry for entry in sent if id(entry) in failed and id(entry) in held]
        self._buffer = again + [entry for entry in self._buffer if id(entry) not in tried]

    async def _send(self, args: list[ScriptArgs]) -> list[BaseException | None]:
        """Run the script once per run, in one pipeline; None for each that ran, else its error
        (an exception is always true)."""
        self.scripts += len(args)
        if len(args) == 1:  # the common round (one slot): no pipeline to build and parse
            return [await self._run(*args[0])]
        pipe = self._redis.pipeline(transaction=False)
        for keys, argv in args:
            pipe.evalsha(self.sha, len(keys), *keys, *argv)  # on a cluster, routed by its keys
        replies = await pipe.execute(raise_on_error=False)
        return [reply if isinstance(reply, BaseException) else None for reply in replies]

    async def _run(self, keys: list[str], args: list[EncodableT]) -> NoScriptError | None:
        try:
            await self._redis.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError as exc:
            return exc
        return None
