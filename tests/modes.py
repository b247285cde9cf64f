"""File modes, for the tests that check what splitbus creates is private."""

from __future__ import annotations

import stat
from pathlib import Path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def folder_modes(root: Path) -> dict[str, int]:
    """Every folder under ``root`` (and itself), by its path relative to ``root``: its mode."""
    return {str(p.relative_to(root)): mode(p) for p in [root, *root.rglob("*")] if p.is_dir()}
