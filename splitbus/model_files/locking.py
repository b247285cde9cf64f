"""A cross-process file lock, and the removal of what a killed holder left behind.

``flock`` on a separately opened file excludes other processes and other threads alike, and the
kernel drops it when its holder dies (even by SIGKILL). So whoever holds the lock knows that no
one else is writing the temporary folders it guards: any that exist were left by a killed run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created 0600 when absent); others wait for it."""
    fd = os.open(lock_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_leftovers(parent: Path, pattern: str) -> list[Path]:
    """Remove the folders in ``parent`` matching ``pattern``; call it only under the lock that
    guards them (then nobody is writing them). Returns what was removed."""
    found = [p for p in parent.glob(pattern) if p.is_dir() and not p.is_symlink()]
    for folder in found:
        shutil.rmtree(folder, ignore_errors=True)
    return found
