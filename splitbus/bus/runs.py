"""Which Redis process serves the bus: a new run id on a primary means the server restarted (from
its AOF, or empty) or a replica took over, and writes the old process had acknowledged may be gone
(``appendfsync everysec`` fsyncs once a second; replication is asynchronous).

Redis keeps the writes it replays or replicates in order, so what survives is a prefix of what was
written: each party that holds state (the API its requests, a worker its tasks and results, the
scheduler its dispatches) can tell what it lost by checking its own latest writes, and re-publish
them, once it has seen a new run (docs/reliability.md, "Writes Redis loses"). This module only
sees the runs: ``INFO server``'s ``run_id`` on every primary (``+info|server`` in the ACL).
"""

from __future__ import annotations

import enum
import logging
import re
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from splitbus.bus.core.cluster import as_cluster
from splitbus.bus.core.connection import is_transient
from splitbus.bus.core.keys import Keys
from splitbus.bus.core.scripts import LuaScript, declare

log = logging.getLogger(__name__)


class Runs(enum.Enum):
    """What :meth:`ServerRuns.poll` saw."""

    FIRST = "first"
    """The first poll: the runs are recorded, nothing to compare them with."""
    SAME = "same"
    """Every primary is a process seen before."""
    NEW = "new"
    """A primary is a process not seen before: a restart or a failover; writes may be lost."""
    UNKNOWN = "unknown"
    """Redis refused ``INFO server`` (an ACL without ``+info|server``): no restart can be seen."""


class ServerRuns:
    """Polls the run id of each primary. Called from a loop the party runs anyway (a heartbeat):
    one ``INFO server`` per primary per poll."""

    def __init__(self, redis: aioredis.Redis, name: str) -> None:
        self._redis = redis
        self._name = name
        self._previous: set[str] | None = None
        self._refused = False
        self._warned = False

    async def poll(self) -> Runs:
        """Compare the primaries' run ids with the previous poll's: a primary that was not one
        then is a new run, even a process seen before (a former primary promoted back has been
        re-synced from the one that replaced it). A transient Redis error is the caller's (its
        loop backs off); anything else (a refused or renamed ``INFO``, a reply without a run id)
        turns the check off rather than the caller's loop: logged once, then ``UNKNOWN``."""
        if self._refused:
            return Runs.UNKNOWN
        try:
            runs = await self._run_ids()
        except Exception as exc:
            if is_transient(exc):
                raise
            return self._unknown(exc)
        return self._compare(runs)

    def _unknown(self, exc: Exception) -> Runs:
        self._refused = isinstance(exc, NoPermissionError) or "NOPERM" in str(exc)
        if not self._warned:
            self._warned = True
            log.warning("%s: no run id from INFO server (%s): a restart losing writes cannot be seen", self._name, exc)
        return Runs.UNKNOWN

    def _compare(self, runs: set[str]) -> Runs:
        previous, self._previous = self._previous, runs
        if previous is None:
            return Runs.FIRST
        new = runs - previous
        if new:
            log.warning("%s: Redis has a new server run (%s): it may have lost writes", self._name, ", ".join(new))
            return Runs.NEW
        return Runs.SAME

    async def _run_ids(self) -> set[str]:
        cluster = as_cluster(self._redis)
        if cluster is None:
            return {_run_id(await self._redis.info("server"))}
        replies = await cluster.info("server", target_nodes=aioredis.RedisCluster.PRIMARIES)
        if isinstance(replies, dict) and "run_id" in replies:  # one primary: redis-py gives its reply bare
            return {_run_id(replies)}
        if not isinstance(replies, dict) or not replies:
            raise ResponseError(f"INFO server gave no replies: {str(replies)[:80]!r}")
        return {_run_id(info) for info in replies.values()}


def _run_id(info: Any) -> str:
    """The ``run_id`` of an ``INFO server`` reply (a dict), checked: 40 hex digits."""
    run = info.get("run_id") if isinstance(info, dict) else None
    if not isinstance(run, str) or not _RUN_ID.fullmatch(run):
        raise ResponseError(f"INFO server gave no run_id: {str(info)[:80]!r}")
    return run


_RUN_ID = re.compile(r"[0-9a-f]{40}")


class RunState(enum.IntEnum):
    """What the ``settle_run`` script found (its reply, decoded in ``CellRun._run``)."""

    SETTLED = 1
    """The cell is settled on the server's run (now, if asked to settle; or INFO gave no run id to
    compare): dispatches go out."""
    RECOVERING = 0
    """The server is a run the cell has not settled on (asked only, nothing written): the dispatch
    script writes nothing until a scheduler settles the cell."""


_SETTLE_RUN = declare(
    LuaScript(
        name="settle_run",
        module=__name__,
        keys=("sb:run:{cell}",),
        argv="1 to settle the cell on the server's run now, 0 only to ask whether it is",
        returns="1 settled (or no run id to compare: INFO refused, or without one); 0 not settled",
        source="""
local info = redis.pcall('INFO', 'server')
local run = type(info) == 'string' and string.match(info, 'run_id.(%x+)')
if not run or redis.call('GET', KEYS[1]) == run then return 1 end
if ARGV[1] ~= '1' then return 0 end
redis.call('SET', KEYS[1], run)
return 1
""",
    )
)


class CellRun:
    """``sb:run:{cell}``: the server run the cell's state was settled on. The dispatch script
    writes nothing while the server's run differs; a scheduler settles the cell once the workers
    have had their grace to re-assert what they hold (``splitbus.scheduler.recovery``)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._key = keys.run
        self._script = _SETTLE_RUN.register(redis)

    async def settled(self) -> bool:
        """Whether the cell is settled on the server's current run."""
        return await self._run(settle=False) is RunState.SETTLED

    async def settle(self) -> None:
        """Settle the cell on the server's current run: dispatches go out again."""
        await self._run(settle=True)

    async def _run(self, settle: bool) -> RunState:
        """The script's one call: settle the cell (``settle``), or only ask whether it is."""
        return RunState(int(await self._script(keys=[self._key], args=[int(settle)])))
