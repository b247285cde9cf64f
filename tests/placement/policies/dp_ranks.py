"""Hand-made DP ranks for the dp, stagger and splitwise_dp policies' tests (any role)."""

from __future__ import annotations

from splitbus.bus.records import Reserved, WorkerLoad
from splitbus.bus.registry import WorkerInfo, WorkerRecord


def rank(
    group: str,
    index: int,
    size: int,
    queued: int = 0,
    free: int = 1000,
    model: str = "m",
    role: str = "mixed",
    running: int = 0,
    alive: bool = True,
    epoch: int = 1,
) -> WorkerInfo:
    """A live rank that has formed its group in ``epoch`` (0: still forming)."""
    load = WorkerLoad(
        running=running, queued_prefill_tokens=queued, free_kv_blocks=free, total_kv_blocks=1000, dp_epoch=epoch
    )
    record = WorkerRecord(
        worker_id=f"{group}-r{index}",
        role=role,
        model=model,
        load=load,
        dp_group=group,
        dp_rank=index,
        dp_size=size,
    )
    return WorkerInfo(record, 0, 3000 if alive else -2, Reserved())
