"""Control commands, for operators and external modules: ``get_payload``, ``get_metrics``,
``connect_rdma``.

A caller writes a ``ControlCommand`` to ``sb:ctrl:{cell}:<worker>`` with a fresh ``task_id`` and reads
the ``ControlReply`` from ``sb:reply:{task_id}``, which expires ``REPLY_TTL_S`` after it is
written. The worker reads its control stream in the ``workers`` group, so a command written
while it restarts is answered when it is back. Commands run at most once: one that was being
handled when the worker died stays pending and is not run again; callers time out and retry
with a new ``task_id``.

Every command gets a reply, an error reply for an unknown command, bad arguments or a failure.
An entry with no ``task_id`` to answer goes to ``sb:dead:{cell}`` instead. Either way the worker goes
on.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import redis.asyncio as aioredis

from splitbus.bus.core import codec, follow
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.keys import WORKER_GROUP
from splitbus.bus.core.replies import for_xadd
from splitbus.bus.core.streams import DeadLetters, GroupConsumer, trim_consumed
from splitbus.bus.messages import ControlCommand, ControlReply

log = logging.getLogger(__name__)
REPLY_TTL_S = 300

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""Takes the command's ``args``, returns the reply's ``result``; raises CommandFailed to refuse."""


class CommandFailed(Exception):
    """A command that could not be carried out; the message is the reply's ``error``."""


class ControlServer:
    """Answers the commands on one worker's control stream with ``handlers``."""

    def __init__(
        self, redis: aioredis.Redis, config: BusConfig, worker_id: str, handlers: Mapping[str, Handler]
    ) -> None:
        self._redis = redis
        self._keys = config.keys
        self.worker_id = worker_id
        self.handlers = dict(handlers)
        self.stream = config.keys.ctrl(worker_id)
        self._group = GroupConsumer(redis, config, self.stream, WORKER_GROUP, worker_id)
        self._dead = DeadLetters(redis, config)

    async def start(self) -> None:
        await self._group.ensure_group()

    async def serve_once(self) -> int:
        """Answer the commands that arrive within one blocking read; returns how many."""
        entries = await self._group.read_raw(100)
        for entry_id, fields in entries:
            await self._answer(entry_id, fields)
        if entries:
            await trim_consumed(self._redis, self.stream)
        return len(entries)

    async def _answer(self, entry_id: str, fields: Mapping[bytes, bytes]) -> None:
        command, task_id, problem = parse(fields)
        if not task_id:
            log.error("control entry %s on %s has no task_id to answer: %s", entry_id, self.stream, problem)
            await self._dead.send(self.stream, WORKER_GROUP, entry_id, fields, "undecodable", 1)
            return
        answer = await self._run(command) if command else ControlReply(task_id, "", ok=False, error=problem)
        answer.worker = self.worker_id
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(self._keys.reply(task_id), for_xadd(codec.encode(answer)))
        pipe.expire(self._keys.reply(task_id), REPLY_TTL_S)
        pipe.xack(self.stream, WORKER_GROUP, entry_id)
        await pipe.execute()

    async def _run(self, command: ControlCommand) -> ControlReply:
        handler = self.handlers.get(command.cmd)
        if handler is None:
            return ControlReply(
                command.task_id,
                command.cmd,
                ok=False,
                error=f"unknown command {command.cmd!r}; known: {', '.join(self.handlers)}",
            )
        try:
            return ControlReply(command.task_id, command.cmd, ok=True, result=await handler(command.args))
        except CommandFailed as exc:
            return ControlReply(command.task_id, command.cmd, ok=False, error=str(exc))
        except Exception as exc:  # a bug in one handler must not take the worker down
            log.exception("control command %s failed", command.cmd)
            return ControlReply(command.task_id, command.cmd, ok=False, error=f"{type(exc).__name__}: {exc}")


def parse(fields: Mapping[bytes, bytes]) -> tuple[ControlCommand | None, str, str]:
    """(the command, or None; the task id to answer, or ""; what is wrong with the entry)."""
    try:
        command = codec.decode(fields)
    except DecodeError as exc:
        return None, _task_id_of(fields), str(exc)
    if not isinstance(command, ControlCommand):
        return None, _task_id_of(fields), f"expected an entry of type 'command', got {type(command).TYPE!r}"
    return command, command.task_id, ""


def _task_id_of(fields: Mapping[bytes, bytes]) -> str:
    """The task id of a malformed command, where one can be made out, to send the error to."""
    data = codec.undecoded(fields)
    task_id = data.get("task_id") if data is not None else None
    return task_id if isinstance(task_id, str) and task_id else ""


async def call(
    redis: aioredis.Redis,
    config: BusConfig,
    worker: str,
    cmd: str,
    args: dict[str, Any] | None = None,
    timeout_s: float = 5.0,
) -> ControlReply:
    """Send one command to ``worker`` and wait for its reply (TimeoutError if none comes)."""
    task_id = uuid.uuid4().hex
    command = for_xadd(codec.encode(ControlCommand(task_id, cmd, args or {})))
    entry_id = await redis.xadd(config.keys.ctrl(worker), command)
    reply = await follow.read_after(redis, {config.keys.reply(task_id): "0"}, 1, max(1, int(timeout_s * 1000)))
    if not reply:
        await redis.xdel(config.keys.ctrl(worker), entry_id)  # withdrawn: a worker started later must not run it
        raise TimeoutError(f"worker {worker} did not answer {cmd} within {timeout_s:g} s (is it running?)")
    answer = codec.decode(reply[0][2])
    assert isinstance(answer, ControlReply)
    return answer
