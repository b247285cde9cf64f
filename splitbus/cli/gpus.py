"""``splitbus up``'s GPUs: each worker process and DP rank it starts gets its own, round-robin
when there are more processes than GPUs, on a machine with several (with one or none, a worker's
``--device auto`` already picks the only choice). The GPUs are counted without importing Paddle
(``device.count_gpus``)."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

from splitbus.cli.common import say
from splitbus.gpu_ops import device
from splitbus.worker import engines


class GpuAllotment:
    """The devices given so far: ask ``args`` for each worker part as it starts, then ``announce``."""

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        """GPUs to share out; fewer than 2: none are given (the workers' ``--device`` stays auto)."""
        self.given: dict[str, str] = {}
        """Part name -> the device it was given, in the order the parts started."""
        self._turn = itertools.count()

    def args(self, part: str) -> list[str]:
        """The worker arguments that give ``part`` the next GPU in turn; none when not sharing."""
        if self.gpus < 2:
            return []
        self.given[part] = f"gpu:{next(self._turn) % self.gpus}"
        return ["--device", self.given[part]]

    def announce(self) -> None:
        """Say, once ``up``'s workers are started, which part got which GPU (nothing if none did)."""
        if self.given:
            say(f"GPUs: {self.gpus}; " + ", ".join(f"{part} {gpu}" for part, gpu in self.given.items()))


def allot(args: argparse.Namespace, count: Callable[[], int] | None = None) -> GpuAllotment:
    """The allotment for ``up``'s workers: none for an engine that runs no Paddle, or when
    ``--worker-arg`` already names a device; else the machine's GPUs (``count``, by default
    ``device.count_gpus``)."""
    named = any(arg == "--device" or arg.startswith("--device=") for arg in args.worker_arg)
    if named or not engines.get(args.engine).capabilities.needs_paddle:
        return GpuAllotment(0)
    return GpuAllotment((count or device.count_gpus)())
