"""Imports run one way (docs/architecture.md): bus imports no other part, and inside it the core
(splitbus/bus/core/) imports no protocol; placement imports only bus, api never imports worker or
the scheduler process, worker never imports api, bench never imports cli, gpu_ops imports only
paddle and numpy, architectures imports only tokenization, grammar (structured output) imports
neither the API nor the workers that share it, the planner imports only the bus."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "splitbus"
_ABOVE_MODEL_FILES = (
    "splitbus.bus",
    "splitbus.api",
    "splitbus.worker",
    "splitbus.gpu_ops",
    "splitbus.cli",
    "splitbus.scheduler",
    "splitbus.placement",
)
"""What model files (``models``) and the architecture table are read by, and so may not read."""
FORBIDDEN = {
    "bus": (
        "splitbus.api",
        "splitbus.worker",
        "splitbus.gpu_ops",
        "splitbus.cli",
        "splitbus.tokenization",
        "splitbus.scheduler",
        "splitbus.placement",
    ),
    # The API places requests itself with --dispatch api: through the placement library, as the
    # scheduler process does, never through that process.
    "api": ("splitbus.worker", "splitbus.gpu_ops", "splitbus.cli", "splitbus.scheduler"),
    # A library under both the scheduler process and the API: it knows neither, nor the workers.
    "placement": (
        "splitbus.api",
        "splitbus.scheduler",
        "splitbus.worker",
        "splitbus.gpu_ops",
        "splitbus.cli",
        "splitbus.tokenization",
    ),
    "worker": ("splitbus.api", "splitbus.cli", "splitbus.scheduler", "splitbus.placement"),
    "scheduler": ("splitbus.api", "splitbus.worker", "splitbus.gpu_ops", "splitbus.cli", "splitbus.tokenization"),
    "tokenization": ("splitbus.bus", "splitbus.api", "splitbus.worker", "splitbus.gpu_ops", "splitbus.cli"),
    "gpu_ops": ("splitbus.",),
    # Structured output, shared by the API (compiles) and the workers (masks): above the bus and
    # the tokenizers only.
    "grammar": ("splitbus.api", "splitbus.worker", "splitbus.gpu_ops", "splitbus.cli", "splitbus.scheduler"),
    # The planner reads the registry and publishes its advice through the bus; it places nothing
    # and runs no engine (docs/planner.md).
    "planner": (
        "splitbus.api",
        "splitbus.scheduler",
        "splitbus.worker",
        "splitbus.placement",
        "splitbus.gpu_ops",
        "splitbus.cli",
        "splitbus.tokenization",
    ),
    # What a benchmark shares with a command lives below both (the default model: the engine's own).
    "bench": ("splitbus.cli",),
    # The one table of model architectures: plain data and config arithmetic that the API, the
    # model-file converter and the engines all read, so it reads none of them.
    "architectures": (*_ABOVE_MODEL_FILES, "splitbus.model_files"),
    "model_files": _ABOVE_MODEL_FILES,
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # from splitbus import cli
    return names


def test_a_part_imported_by_name_from_the_package_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("from splitbus import scheduler\nfrom splitbus.placement import policies\n")
    assert {"splitbus.scheduler", "splitbus.placement.policies"} <= _imports(path)


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_part_imports_only_what_it_may(part: str) -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in (PACKAGE / part).rglob("*.py")
        for name in _imports(path)
        if name.startswith(FORBIDDEN[part]) and not name.startswith(f"splitbus.{part}")
    ]
    assert offenders == []


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_base(node: ast.ImportFrom, package: list[str]) -> str:
    """The module a ``from ... import`` names, relative ones resolved against ``package``."""
    if not node.level:
        return node.module or ""
    return ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])


def _internal_imports(path: Path, root: Path, modules: set[str]) -> dict[str, int]:
    """The splitbus modules ``path`` imports, each with the line of its first import: every
    import statement, those inside functions and ``if TYPE_CHECKING:`` blocks included (ast.walk
    sees them all). ``from a import b`` imports module ``a.b`` when there is one, else ``a``."""
    name = _module_name(path, root).split(".")
    package = name if path.name == "__init__.py" else name[:-1]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, package)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target in modules:
                found.setdefault(target, node.lineno)
    return found


def _import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """Module -> the modules of the package at ``root`` it imports -> the line of that import."""
    paths = {_module_name(path, root): path for path in root.rglob("*.py")}
    return {name: _internal_imports(path, root, set(paths)) for name, path in paths.items()}


def _cycle_through(start: str, graph: dict[str, dict[str, int]]) -> list[str] | None:
    """The shortest import path from ``start`` back to itself (breadth first), if there is one."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in came_from:
        reached = []
        for here in frontier:
            for there in sorted(set(graph[here]) - set(came_from)):
                came_from[there] = here
                reached.append(there)
        frontier = reached
    if start not in came_from:
        return None
    path = [start, came_from[start]]
    while path[-1] != start:
        path.append(came_from[path[-1]])
    return path[::-1]


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """A cycle through each module that is on one (a module already on a reported cycle starts
    no search of its own)."""
    cycles: list[list[str]] = []
    for start in sorted(graph):
        cycle = None if any(start in c for c in cycles) else _cycle_through(start, graph)
        if cycle:
            cycles.append(cycle)
    return cycles


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    hops = [f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*hops, cycle[-1]])


def test_no_import_cycle() -> None:
    # Deferred (in-function) and TYPE_CHECKING imports count: a cycle hidden behind them is still
    # two modules that each need the other, and one top-level import more between them breaks.
    graph = _import_graph()
    assert [_describe(cycle, graph) for cycle in _cycles(graph)] == []


def _graph_of(tmp_path: Path, files: dict[str, str]) -> dict[str, dict[str, int]]:
    """The import graph of a made-up ``splitbus`` package: its files' paths and texts."""
    for name, text in files.items():
        (tmp_path / "splitbus" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "splitbus" / name).write_text(text)
    return _import_graph(tmp_path / "splitbus")


def test_cycle_check_sees_relative_deferred_and_type_checking_imports(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/one.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .two import Two\n",
        "a/two.py": "def later():\n    from splitbus.a import one\n",
        "a/sub/__init__.py": "",
        "a/sub/four.py": "import os\nfrom ..one import One\nfrom .. import two\n",
    }
    graph = _graph_of(tmp_path, files)
    assert graph["splitbus.a.sub.four"] == {"splitbus.a.one": 2, "splitbus.a.two": 3}
    assert _cycles(graph) == [["splitbus.a.one", "splitbus.a.two", "splitbus.a.one"]]
    assert _describe(_cycles(graph)[0], graph) == "splitbus.a.one (line 4) -> splitbus.a.two (line 2) -> splitbus.a.one"


def _longest_chain(graph: dict[str, dict[str, int]], package: str) -> list[str]:
    """The longest chain of imports among the modules of ``package`` (the package itself and every
    module below it), each module importing the next: the modules a reader of its first must read
    before it makes sense. The graph has no cycle (test_no_import_cycle), so this is the longest
    path in a DAG, found by depth first search with memo; of equal chains, the first by name."""
    inside = {name for name in graph if name == package or name.startswith(f"{package}.")}
    chains: dict[str, list[str]] = {}

    def chain_from(module: str) -> list[str]:
        if module not in chains:
            tails = [chain_from(there) for there in sorted(set(graph[module]) & inside)]
            chains[module] = [module, *max(tails, key=len, default=[])]
        return chains[module]

    return max((chain_from(name) for name in sorted(inside)), key=len, default=[])


def test_longest_chain_counts_modules_inside_the_package_only() -> None:
    graph: dict[str, dict[str, int]] = {
        "p": {"p.a": 1},
        "p.a": {"p.b": 1, "p.sub.c": 2, "q.x": 3},
        "p.b": {"p.sub.c": 1},
        "p.sub.c": {"q.x": 1},
        "p.d": {"p.b": 1},
        "q.x": {"q.y": 1},
        "q.y": {},
        "pq": {"p": 1},
    }
    assert _longest_chain(graph, "p") == ["p", "p.a", "p.b", "p.sub.c"]
    assert _longest_chain(graph, "p.sub") == ["p.sub.c"]
    assert _longest_chain(graph, "q") == ["q.x", "q.y"]
    assert _longest_chain(graph, "r") == []


# The worker's longest chain ran 15 modules deep (worker -> recovery -> feed -> receiver -> handoff
# -> cancellation -> publisher -> shared -> config -> engines -> engines.base -> engines.interface ->
# engines.prefix -> sequence -> text): a reader of the worker had to hold 15 files to follow one.
# With the core and its shell: 6 (worker -> config -> engines -> engines.base -> engines.interface
# -> sequence).
WORKER_IMPORT_DEPTH = 6


def test_worker_import_depth() -> None:
    chain = _longest_chain(_import_graph(), "splitbus.worker")
    assert len(chain) <= WORKER_IMPORT_DEPTH, f"{len(chain)} modules deep: {' -> '.join(chain)}"


LAYERS = {"splitbus.bus.core": ("splitbus.bus.core", "splitbus.env")}
"""Layer -> the only splitbus modules (and packages under them) its modules may import. The bus
in two layers (docs/bus.md, "Two layers"): its core (connection, codec, keys, scripts, batching,
the stream primitives) imports nothing of splitbus but itself and the environment: no protocol
(``splitbus/bus/*.py``, ``messages/``), no other part. The protocols stand on the core."""


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _crossings(graph: dict[str, dict[str, int]], layer: str, allowed: tuple[str, ...]) -> list[str]:
    """Each import by a module of ``layer`` of a module outside ``allowed``, with its line."""
    return [
        f"{module} (line {line}) imports {target}"
        for module, targets in sorted(graph.items())
        if _within(module, (layer,))
        for target, line in sorted(targets.items())
        if not _within(target, allowed)
    ]


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_layer_imports_only_what_is_below_it(layer: str) -> None:
    graph = _import_graph()
    assert [module for module in graph if _within(module, (layer,))], f"{layer} has no module: the check checks nothing"
    assert _crossings(graph, layer, LAYERS[layer]) == []


def test_the_layer_check_sees_every_crossing(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "env.py": "",
        "bus/__init__.py": "",
        "bus/tasks.py": "from splitbus.bus.core import codec\n",
        "bus/core/__init__.py": "",
        "bus/core/codec.py": "from splitbus import env\n",
        "bus/core/streams.py": "from splitbus.bus.core import codec\nfrom .. import tasks\n",
        "bus/core/later.py": "def f():\n    from splitbus.bus.tasks import Task\n",
        "bus/core_extra.py": "",
        "bus/core/wide.py": "import splitbus.bus.core_extra\n",
    }
    graph = _graph_of(tmp_path, files)
    assert _crossings(graph, "splitbus.bus.core", ("splitbus.bus.core", "splitbus.env")) == [
        "splitbus.bus.core.later (line 2) imports splitbus.bus.tasks",
        "splitbus.bus.core.streams (line 2) imports splitbus.bus.tasks",
        "splitbus.bus.core.wide (line 1) imports splitbus.bus.core_extra",
    ]
