"""Configuration of one API process, validated once."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from splitbus.bus.config import BusConfig


@dataclass(frozen=True)
class ApiConfig:
    bus: BusConfig
    models: tuple[tuple[str, Path], ...]
    """(served name, Hugging Face folder) of each model whose tokenizer this API loads."""
    api_keys: tuple[str, ...] = ()
    node_id: str = field(default_factory=lambda: f"api-{uuid.uuid4().hex[:8]}")
    max_body_bytes: int = 4 * 1024 * 1024
    max_inflight: int = 1024
    """Requests in flight in this process beyond which new ones get 429."""
    max_backlog: int = 10_000
    """Entries in the request stream (not yet trimmed: unplaced or recent) beyond which new
    requests get 429: the schedulers are behind."""
    request_timeout_s: float = 600.0
    """Deadline of a request; past it the client gets an error and workers free its state."""
    redis_connections: int = 7
    """Connections of the shared pool (XADD, cancellations, registry, wake-ups); with the
    reader's one, 8 in all by default, however many streams are open."""
    reader_shards: int = 1
    """Connections that follow result streams; each multiplexes any number of streams."""
    registry_refresh_s: float = 0.5

    def __post_init__(self) -> None:
        names = [name for name, _ in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be unique: {names}")
        if min(self.max_body_bytes, self.max_inflight, self.max_backlog, self.redis_connections, self.reader_shards) < 1:
            raise ValueError("limits must be >= 1")
        if self.request_timeout_s <= 0 or self.registry_refresh_s <= 0:
            raise ValueError("timeouts must be > 0")

    @property
    def max_redis_connections(self) -> int:
        """The most Redis connections this process holds, whatever the number of streams."""
        return self.redis_connections + self.reader_shards
