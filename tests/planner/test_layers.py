"""The planner's core does no I/O (splitbus/planner/__init__.py): its modules define no coroutine,
and importing it loads no event loop, socket or Redis client; only the service does."""

from __future__ import annotations

import ast

from tests.test_layering import PACKAGE
from tests.worker.test_layers import IO_MODULES, io_modules_loaded_by

CORE = ("config", "core", "rates", "model", "fit", "predictors", "hysteresis", "autoscale")


def _io_uses(name: str) -> list[str]:
    """Each coroutine, await and import of an I/O module in core module ``name``, with its line."""
    found = []
    for node in ast.walk(ast.parse((PACKAGE / "planner" / f"{name}.py").read_text())):
        if isinstance(node, (ast.AsyncFunctionDef, ast.Await)):
            found.append(f"{name}.py:{node.lineno}: {type(node).__name__}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{name}.py:{node.lineno}: imports {m}" for m in modules if m.split(".")[0] in IO_MODULES]
    return found


def test_the_core_defines_no_coroutine_and_imports_no_io() -> None:
    assert [use for name in CORE for use in _io_uses(name)] == []


def test_importing_the_core_loads_no_io_module() -> None:
    """Nothing the core imports, however deep (the bus's records and roles), loads one either."""
    assert io_modules_loaded_by("splitbus.planner.core") == "[]"


def test_the_check_sees_the_shell() -> None:
    assert _io_uses("service")  # the shell awaits Redis: in the core, the check above would fail
