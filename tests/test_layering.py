"""Imports run one way (docs/architecture.md): bus imports no other part, api never imports
worker, worker never imports api, gpu_ops imports only paddle and numpy."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "splitbus"
FORBIDDEN = {
    "bus": (
        "splitbus.api",
        "splitbus.worker",
        "splitbus.gpu_ops",
        "splitbus.cli",
        "splitbus.tokenization",
        "splitbus.scheduler",
    ),
    "api": ("splitbus.worker", "splitbus.gpu_ops", "splitbus.cli", "splitbus.scheduler"),
    "worker": ("splitbus.api", "splitbus.cli", "splitbus.scheduler"),
    "scheduler": ("splitbus.api", "splitbus.worker", "splitbus.gpu_ops", "splitbus.cli", "splitbus.tokenization"),
    "tokenization": ("splitbus.bus", "splitbus.api", "splitbus.worker", "splitbus.gpu_ops", "splitbus.cli"),
    "gpu_ops": ("splitbus.",),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_part_imports_only_what_it_may(part: str) -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in (PACKAGE / part).rglob("*.py")
        for name in _imports(path)
        if name.startswith(FORBIDDEN[part]) and not name.startswith(f"splitbus.{part}")
    ]
    assert offenders == []
