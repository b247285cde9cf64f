"""The worker's two layers (docs/architecture.md, "The worker: a core and its shell"): the core
does no I/O and imports nothing of the shell; the shell's parts import the core and the outbox,
not each other, and ``worker.py`` wires them. A crossing fails here, naming it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.test_layering import PACKAGE, _import_graph

WORKER = "splitbus.worker."
CORE = {"core", "table", "effects", "sequence", "text", "twins"}
"""The core: the rules, the request table, the effects, a request's state and its text, twins."""
BESIDE_CORE = {"kv_proof", "engines.interface"}
"""What the core may import besides itself: the KV frame's header and proof check (``kv_proof``),
and the engine's interface."""
SHARED = {"metrics", "config", "spans"}
"""What any part of the shell may read, and the core does not: the worker's metrics, config and
spans (the traces each part adds to, as to the metrics)."""
SHELL_BASE = {"outbox", "transfer"}
"""What the shell's parts share: the outbox, where every part puts the core's effects (no I/O;
the publisher writes them), and the KV transfer's frames over TCP (the hand-off, the P-D links
and the control commands send with it; the worker serves it)."""
SHELL_EDGES = {("dp", "steps"), ("handoff", "links"), ("control", "links")}
"""The shell's parts that build on another part: a DP rank runs the engine's steps, and P's
hand-off and the control commands use the P-D links."""


def _worker_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    graph = _import_graph(root)
    return {
        name.removeprefix(WORKER): {t.removeprefix(WORKER) for t in targets if t.startswith(WORKER)}
        for name, targets in graph.items()
        if name.startswith(WORKER) and not name.startswith(WORKER + "engines")
    }


def _core_crossings(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, t) for m in CORE & set(graph) for t in graph[m] if t not in CORE | BESIDE_CORE}


def test_the_core_imports_nothing_of_the_shell() -> None:
    assert _core_crossings(_worker_graph()) == set()


def test_the_shells_parts_import_the_core_not_each_other() -> None:
    graph = _worker_graph()
    shell = set(graph) - CORE - BESIDE_CORE - SHARED - SHELL_BASE - {"", "worker", "engines"}
    crossings = {(m, t) for m in shell for t in graph[m] & shell} - SHELL_EDGES
    assert crossings == set()
    assert {(m, t) for m in SHELL_BASE for t in graph[m] & (shell | {"worker"})} == set()
    assert {t for t in graph["worker"] if t in shell} == shell - {"dp"}  # the CLI gives a DP rank its stepper


def test_the_core_does_no_io() -> None:
    """No coroutine, no event loop, no Redis client in the core's modules: what takes time is
    the shell's, which awaits it between the core's calls."""
    found = []
    for name in sorted(CORE):
        tree = ast.parse((PACKAGE / "worker" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.AsyncFunctionDef, ast.Await)):
                found.append(f"{name}.py:{node.lineno}: {type(node).__name__}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found += [f"{name}.py:{node.lineno}: imports {m}" for m in modules if m.split(".")[0] in IO_MODULES]
    assert found == []


IO_MODULES = {"asyncio", "redis", "socket", "aiohttp", "httpx"}


def test_importing_the_core_loads_no_io_module() -> None:
    """Not only the core's own modules: nothing it imports, however deep (the bus's records and
    messages, the tokenizer, the engine's interface), loads an event loop, a socket or a Redis
    client. A fresh interpreter, so that no other test's imports count."""
    assert io_modules_loaded_by("splitbus.worker.core") == "[]"


def io_modules_loaded_by(module: str) -> str:
    """The I/O modules importing ``module`` loads, as a printed list, in a fresh interpreter."""
    probe = (
        f"import sys, {module}\n"
        f"print(sorted(m for m in {sorted(IO_MODULES | {'redis.asyncio'})!r} if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    return done.stdout.strip()


def test_the_check_sees_a_crossing(tmp_path: Path) -> None:
    """A core module that imports the feed, even under TYPE_CHECKING, is a crossing."""
    source = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from splitbus.worker.feed import TaskFeed\n"
    (tmp_path / "splitbus" / "worker").mkdir(parents=True)
    for name in ("__init__.py", "worker/__init__.py", "worker/feed.py", "worker/table.py"):
        (tmp_path / "splitbus" / name).write_text("")
    (tmp_path / "splitbus" / "worker" / "core.py").write_text(source + "from splitbus.worker import table\n")
    assert _core_crossings(_worker_graph(tmp_path / "splitbus")) == {("core", "feed")}
