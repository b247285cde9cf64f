from __future__ import annotations

import socket
import os
from dataclasses import dataclass, field

from splitbus.bus.config import BusConfig

MODES = ("splitwise", "mixed", "dp")


def default_name() -> str:
    return f"scheduler-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class SchedulerConfig:
    bus: BusConfig
    mode: str = "splitwise"
    name: str = field(default_factory=default_name)
    """Consumer name in the ``schedulers`` group; stable across restarts of one replica."""
    refresh_s: float = 0.1
    """Age bound of the registry snapshot used for placement."""
    batch: int = 256
    """Requests read per XREADGROUP."""
    no_worker_wait_s: float = 10.0
    """How long a request waits for an eligible worker before its client gets a 503."""
    dispatched_ttl_s: int = 3600
    claim_every_s: float = 1.0
    """How often this replica takes over requests left pending by a dead replica."""
    reap_every_s: float = 1.0
    """How often this replica looks for workers whose lease expired, to move their tasks."""
    stagger: bool = True
    """dp mode: hold arrivals and release them as one batch spread over the ranks."""
    stagger_max_wait_s: float = 0.05
    """dp mode: the longest an arrival is held (the window closes earlier under load)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.refresh_s <= 0 or self.no_worker_wait_s <= 0 or self.batch < 1:
            raise ValueError("refresh_s, no_worker_wait_s and batch must be positive")
