"""``splitbus up``'s GPUs: each worker process and DP rank it starts gets its own, round-robin
when there are more processes than GPUs, on a machine with several (with one, a worker's
``--device auto`` already picks it); and workers that share a GPU each get their part of its
memory (``--gpu-memory-fraction``), so that none sizes its KV cache as if it were alone. The GPUs
are counted without importing Paddle (``device.count_gpus``)."""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable

from splitbus.cli.common import say
from splitbus.gpu_ops import device
from splitbus.worker import engines
from splitbus.worker.engines.base import GPU_MEMORY_FRACTION


class GpuAllotment:
    """The devices given so far: ask ``args`` for each worker part as it starts, then ``announce``."""

    def __init__(self, gpus: int, spread: bool = False, sharers: int = 1, fraction: str | None = None) -> None:
        self.gpus = gpus
        """GPUs on the machine; 0: nothing is given or said."""
        self.spread = spread
        """Whether each part is given a GPU in turn (``--device``); False: the device is the workers' own."""
        self.sharers = sharers
        """Workers on one GPU at most, as planned."""
        self.fraction = fraction
        """The ``--gpu-memory-fraction`` each part is given; None: none (alone on its GPU, or the user's)."""
        self.given: dict[str, str] = {}
        """Part name -> the device it was given, in the order the parts started."""
        self._turn = itertools.count()

    def args(self, part: str) -> list[str]:
        """The worker arguments that give ``part`` the next GPU in turn and its part of that GPU."""
        given = ["--gpu-memory-fraction", self.fraction] if self.fraction else []
        if self.spread:
            self.given[part] = f"gpu:{next(self._turn) % self.gpus}"
            given += ["--device", self.given[part]]
        return given

    def announce(self) -> None:
        """Say, once ``up``'s workers are started, which part got which GPU and how many share one."""
        said = [", ".join(f"{part} {gpu}" for part, gpu in self.given.items())] if self.given else []
        if self.sharers > 1:
            each = f"--gpu-memory-fraction {self.fraction}" if self.fraction else "the --gpu-memory-fraction given"
            said.append(f"up to {self.sharers} workers on a GPU, each {each}")
        if self.gpus and said:
            say(f"GPUs: {self.gpus}; " + "; ".join(said))


def planned_workers(args: argparse.Namespace, counts: tuple[int, int, int]) -> int:
    """Worker processes ``up`` may run at once for ``counts`` (prefill, decode, mixed): every DP
    rank, and with ``--autoscale`` its most of each role."""
    prefill, decode, mixed = counts
    if args.autoscale is not None:
        prefill = decode = args.autoscale.high
    return prefill * args.prefill_dp + decode * args.decode_dp + mixed + args.dp


def allot(args: argparse.Namespace, workers: int, count: Callable[[], int] | None = None) -> GpuAllotment:
    """The allotment for ``up``'s ``workers`` processes: none for an engine that runs no Paddle,
    on a machine without GPUs (``count``, by default ``device.count_gpus``) or with
    ``--worker-arg`` naming the CPU; no devices when it names one (all then share it); a part of
    ``GPU_MEMORY_FRACTION`` to each worker of a GPU that several share, unless it names one."""
    named = given(args.worker_arg, "--device")
    if named == "cpu" or not engines.get(args.engine).capabilities.needs_paddle:
        return GpuAllotment(0)
    gpus = (count or device.count_gpus)()
    if not gpus:
        return GpuAllotment(0)
    sharers = math.ceil(workers / (gpus if named is None else 1))
    own = sharers < 2 or given(args.worker_arg, "--gpu-memory-fraction") is not None
    return GpuAllotment(gpus, named is None and gpus > 1, sharers, None if own else share(sharers))


def share(sharers: int) -> str:
    """Each of ``sharers`` workers' part of a GPU, rounded down (their sum stays within the default)."""
    return f"{math.floor(GPU_MEMORY_FRACTION / sharers * 10_000) / 10_000:g}"


def given(worker_args: list[str], option: str) -> str | None:
    """The value ``worker_args`` give the worker's ``option`` (the last, as argparse takes it),
    named in full or by a prefix, which argparse takes as the option when no other has it (and
    refuses when another has); None when not given."""
    value = None
    for i, arg in enumerate(worker_args):
        name, equals, inline = arg.partition("=")
        if name.startswith("--") and len(name) > 2 and option.startswith(name):
            value = inline if equals else (worker_args[i + 1] if i + 1 < len(worker_args) else "")
    return value
