"""Configuration of one worker process, validated once."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages.control import MAX_DRAIN_TIMEOUT_S
from splitbus.bus.roles import ROLES, Role
from splitbus.worker import engines


def default_worker_id(role: str, pid: int | None = None) -> str:
    """``<role>-<host>-<pid>``: this process's id (``pid``: another process's on this host, as
    ``up`` names the workers it started)."""
    return f"{role}-{socket.gethostname()}-{os.getpid() if pid is None else pid}"


@dataclass(frozen=True)
class WorkerConfig:
    bus: BusConfig
    role: str
    model_dir: Path
    model_name: str
    engine: str = "sim"
    """A registered engine's name (``splitbus.worker.engines.names()``)."""
    worker_id: str = ""
    max_requests: int = 64
    """Requests held at once (queued, waiting for KV, running); beyond it the worker reads no task."""
    max_prefill_tokens: int = 4096
    """Prompt tokens in one prefill batch."""
    block_size: int = 16
    heartbeat_s: float = 0.5
    lease_ms: int = 3000
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0
    """0: a free port."""
    transfer_advertise_host: str = ""
    """The address other workers connect to (registered as the KV endpoint); default: the
    bind address, or the host name when binding to all interfaces (0.0.0.0)."""
    transfer_timeout_s: float = 10.0
    kv_wait_s: float = 30.0
    """How long P waits for D's reservation, and D for P's KV, before failing the request."""
    dp_group: str = ""
    """The DP group this worker is a rank of ("" for a worker on its own). A group's ranks share one
    role: mixed, prefill (each step a prefill or an idle forward) or decode (a decode or an idle one)."""
    dp_rank: int = -1
    dp_size: int = 0
    dp_align_ms: float = 0.0
    """A rank with new prefill work waits up to this long for the others' so prefills share a step
    (0, the default: off). Off since the ranks bind late work: a batch part that comes just after
    the plans were posted joins the step on its own rank, which the ranks that posted theirs cannot
    see, so they waited out the step idle for it (docs/dp.md, "Engine side")."""
    dp_barrier_timeout_s: float = 5.0
    """A rank missing from a step for this long breaks the group."""
    ep: bool = False
    """Expert parallelism: the group's ranks split each MoE layer's experts between them and
    exchange tokens in every MoE layer (``splitbus.gpu_ops.expert_parallel``)."""
    ep_timeout_s: float = 10.0
    drain_timeout_s: float = 0.0
    """SIGTERM drains the worker for up to this long (``Worker.drain``): it takes no new task,
    finishes what it holds, leaves the registry and exits 0; what it still holds then is moved
    by the reaper. 0, the default: SIGTERM stops at once, as SIGINT does."""
    """With ``ep``: a forward whose exchanges have not finished after this long (a rank died or
    hangs) breaks the group."""

    @property
    def advertised_transfer_host(self) -> str:
        if self.transfer_advertise_host:
            return self.transfer_advertise_host
        return socket.gethostname() if self.transfer_host in ("0.0.0.0", "::") else self.transfer_host

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        capabilities = engines.get(self.engine).capabilities  # ValueError naming the registered ones
        if self.role != Role.MIXED and not capabilities.kv_transfer:
            raise ValueError(f"the {self.engine} engine cannot ship KV: it runs only as --role mixed")
        if min(self.max_requests, self.max_prefill_tokens, self.block_size) < 1:
            raise ValueError("capacities must be >= 1")
        if self.lease_ms < self.heartbeat_s * 2000:
            raise ValueError("lease_ms must cover at least two heartbeats")
        self._check_dp()
        self._check_drain()
        if not self.worker_id:
            object.__setattr__(self, "worker_id", default_worker_id(self.role))

    def _check_dp(self) -> None:
        """A DP rank names its group and a rank within its size; a worker on its own names neither."""
        if self.dp_size and not (self.dp_group and 0 <= self.dp_rank < self.dp_size):
            raise ValueError("a DP rank needs --dp-group and 0 <= --dp-rank < --dp-size")
        if not self.dp_size and (self.dp_group or self.dp_rank != -1):
            raise ValueError("--dp-group and --dp-rank need --dp-size (the group's ranks)")
        self._check_ep()

    def _check_drain(self) -> None:
        """A drain is bounded, and a worker's own: a DP rank that left alone would break its group
        (its ranks step together), so a group is stopped whole."""
        if not 0 <= self.drain_timeout_s <= MAX_DRAIN_TIMEOUT_S:
            raise ValueError(f"--drain-timeout must be in [0, {MAX_DRAIN_TIMEOUT_S}] seconds")
        if self.drain_timeout_s and self.dp_size:
            raise ValueError("--drain-timeout drains a worker on its own, not a DP rank (a group stops whole)")

    def _check_ep(self) -> None:
        """Expert parallelism needs a group to split experts over, and an engine that runs them."""
        if self.ep and (self.dp_size < 2 or not engines.get(self.engine).capabilities.expert_parallel):
            raise ValueError(
                f"--ep splits experts over a DP group of 2 or more ranks of an engine that runs them "
                f"(paddle); got --dp-size {self.dp_size} and the {self.engine} engine"
                + (" (which simulates EP's cost: --sim-ep-a2a-ms)" if self.engine == "sim" else "")
            )
        if self.ep_timeout_s <= 0:
            raise ValueError("--ep-timeout must be positive")
