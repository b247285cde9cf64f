"""What every room of a worker shares: its config, its Redis client, the request table, the
engine, the loops one-shot work is spawned on, and the two events its loops wait on."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import redis.asyncio as aioredis

from splitbus.bus.core.loops import Loops
from splitbus.worker.config import WorkerConfig
from splitbus.worker.engines import Engine
from splitbus.worker.requests import RequestTable


@dataclass(frozen=True)
class Shared:
    config: WorkerConfig
    redis: aioredis.Redis
    table: RequestTable
    engine: Engine
    loops: Loops
    wake: asyncio.Event
    """Set when the engine loop has something new to do (work came, a request left)."""
    room: asyncio.Event
    """Set when a request left: the task feed, full, waits on it to read again."""

    @property
    def id(self) -> str:
        return self.config.worker_id
