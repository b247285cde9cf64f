"""What runs the engine's steps: a worker is given a stepper, which decides when it prefills,
decodes or waits. ``SoloStepper`` is a worker on its own; ``splitbus.worker.dp.DpStepper`` is one
rank of a DP group, which steps with the other ranks."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from splitbus.bus.core.loops import Loops
from splitbus.bus.registry import Registry
from splitbus.worker.config import WorkerConfig
from splitbus.worker.publisher import Publisher
from splitbus.worker.requests import RequestTable
from splitbus.worker.steps import EngineSteps


@dataclass(frozen=True)
class StepParts:
    """The parts of a worker a stepper works with."""

    config: WorkerConfig
    redis: aioredis.Redis
    registry: Registry
    table: RequestTable
    steps: EngineSteps
    """The engine's steps and the load they leave."""
    publisher: Publisher
    loops: Loops
    """The worker's loops: one-shot work is spawned there; a stepper that stops the worker stops them."""
    settle: Callable[[], Awaitable[None]]
    """A worker back from a lapsed lease drops what moved away, before anything else."""


class Stepper(Protocol):
    async def start(self) -> None:
        """Called once, after the worker has joined the bus and before its first step."""

    async def step(self) -> None:
        """Called by the engine loop until the worker stops: one turn (a wait for work, or a step)."""

    async def work_arrived(self) -> None:
        """Called once the task feed has taken tasks: the engine loop has work."""


StepperFactory = Callable[[StepParts], Stepper]
"""How a worker is given its stepper: called with the worker's parts once they exist."""


class SoloStepper:
    """A worker on its own: prefill what is queued, then decode what runs; results go out after
    each engine call, written by the publisher while the engine goes on (a first token waits
    neither for the decode nor for Redis)."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    async def start(self) -> None:
        pass

    async def step(self) -> None:
        p = self.parts
        await p.settle()  # back from a stop: what moved away is dropped before anything
        await p.steps.wait_for_work()
        await p.steps.prefill_queued()
        p.publisher.soon()
        await p.steps.decode_running()
        p.publisher.soon()

    async def work_arrived(self) -> None:
        self.parts.steps.wake.set()
