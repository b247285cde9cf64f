"""Readings of a made-up fleet for the planner's tests: workers with the counters given."""

from __future__ import annotations

from typing import Any

from splitbus.bus.records import Reserved, WorkerLoad
from splitbus.planner.core import Reading, WorkerReading


def worker(worker_id: str, role: str = "prefill", dp_size: int = 1, reserved: int = 0, **load: Any) -> WorkerReading:
    """A worker of ``role`` whose load has the fields ``load`` (the rest 0)."""
    return WorkerReading(worker_id, role, dp_size, 16, WorkerLoad(**load), Reserved(reserved_requests=reserved))


def reading(at_s: float, *workers: WorkerReading, unread: int = 0, held: int = 0) -> Reading:
    return Reading(at_s, tuple(workers), unread, held)


def prefiller(
    worker_id: str = "p1", prefills: int = 0, tokens_each: int = 1000, busy_s: float = 0.0, **load: Any
) -> WorkerReading:
    """A prefill worker that prefilled ``prefills`` prompts of ``tokens_each`` tokens in ``busy_s``."""
    return worker(
        worker_id,
        prefills_done=prefills,
        prompt_tokens_done=prefills * tokens_each,
        prefill_busy_us=round(busy_s * 1e6),
        **load,
    )


def decoder(
    worker_id: str = "d1", decodes: int = 0, tokens_each: int = 199, batch: float = 10, itl_s: float = 0.01, **load: Any
) -> WorkerReading:
    """A decode worker that finished ``decodes`` requests of ``tokens_each`` decode tokens, in steps of
    ``batch`` requests that took ``itl_s`` each."""
    tokens = decodes * tokens_each
    steps = round(tokens / batch)
    return worker(
        worker_id,
        role="decode",
        decodes_done=decodes,
        decode_tokens_done=tokens,
        decode_steps=steps,
        decode_time_us=round(steps * itl_s * 1e6),
        **load,
    )
