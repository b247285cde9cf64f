"""One module per Redis protocol: a key name is built (``keys.<name>``) only in the bus module
that owns the key, or in the few bus modules docs/bus.md lists as touching it; outside
``splitbus/bus/`` only the read-only operator and benchmark views listed here name keys. What
this parses is the source (ast), so a new ``keys.<name>`` anywhere is seen without a run."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import splitbus
import splitbus.bus
from splitbus.bus.core.scripts import SCRIPTS
from tests.bus.slots import key_names

ROOT = Path(splitbus.__file__).parent
DOCS = ROOT.parent / "docs" / "bus.md"
ALLOWED_OUTSIDE = {
    "splitbus/cli/status_cmd.py": "`splitbus status`: an operator's read-only view of the bus",
    "splitbus/cli/up.py": "prints the request stream's name in its start-up hint (XINFO GROUPS)",
    "splitbus/bench": "benchmarks drive and read the bus directly, with sync clients",
}
"""Paths outside splitbus/bus/ that may name keys (docs/bus.md says so), and why."""
RECEIVER = re.compile(r"(^|\.)_?keys$")
"""How code holds a ``Keys``: ``keys``, ``self._keys``, ``config.bus.keys``..."""


MEMBERS = key_names()
"""Every key builder of ``Keys`` and the name docs/bus.md gives its key."""


def key_uses(source: str) -> Iterator[tuple[int, str]]:
    """(line, builder) for each ``<keys>.<builder>`` in ``source``, called or not (``map(keys.tasks,
    ...)`` names keys too), on anything held as ``keys`` or made by ``Keys(...)``."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or node.attr not in MEMBERS:
            continue
        held = node.value
        made = isinstance(held, ast.Call) and ast.unparse(held.func).split(".")[-1] == "Keys"
        if made or RECEIVER.search(ast.unparse(held)):
            yield node.lineno, node.attr


def _uses_by_file() -> dict[str, list[tuple[int, str]]]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        uses = list(key_uses(path.read_text()))
        if uses:
            found[path.relative_to(ROOT.parent).as_posix()] = uses
    return found


def _allowed(path: str) -> bool:
    return any(path == allowed or path.startswith(allowed + "/") for allowed in ALLOWED_OUTSIDE)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("self.keys.current(request_id)", [(1, "current")]),
        ("redis.get(config.bus.keys.moved(r))", [(1, "moved")]),
        ("x = self._keys.rdma(p, d)", [(1, "rdma")]),
        ("names = map(keys.tasks, ids)", [(1, "tasks")]),
        ("redis.xlen(state.config.bus.keys.requests)", [(1, "requests")]),
        ("Keys(prefix).requests", [(1, "requests")]),
        ("self.tasks.read(10)\nself.lease.renew()\nmonkeys.worker(1)", []),
        ("keys.prefix\nkeys.kind(key)", []),
    ],
)
def test_the_check_sees_a_key_built_however_it_is_written(source: str, found: list[tuple[int, str]]) -> None:
    assert list(key_uses(source)) == found


def test_no_module_outside_the_bus_builds_a_key_name() -> None:
    offenders = [
        f"{path}:{line} keys.{name}"
        for path, uses in _uses_by_file().items()
        if not path.startswith("splitbus/bus/") and not _allowed(path)
        for line, name in uses
    ]
    assert offenders == [], "move these reads and writes into the bus module that owns the key (docs/bus.md)"


def test_every_allowed_path_still_needs_its_allowance() -> None:
    users = _uses_by_file()
    stale = [
        allowed for allowed in ALLOWED_OUTSIDE if not any(p == allowed or p.startswith(allowed + "/") for p in users)
    ]
    assert stale == []


def _cells(cell: str, keys: bool = True) -> set[str]:
    """The backticked names in a cell: the keys (``sb:...``), or the other names (scripts)."""
    return {name for name in re.findall(r"`([^`]+)`", cell) if name.startswith("sb:") == keys}


def _owner_table() -> dict[str, tuple[set[str], set[str], set[str]]]:
    """docs/bus.md's owner table: module -> (keys it owns, others' keys it touches, scripts)."""
    text = DOCS.read_text()
    section = text[text.index("## Who owns which key") :]
    section = section[: section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`splitbus/bus/"):
            rows[cells[0].strip("`")] = (_cells(cells[1]), _cells(cells[2]), _cells(cells[3], keys=False))
    return rows


def _expected_rows() -> str:
    lines = []
    for path, uses in _uses_by_file().items():
        if path.startswith("splitbus/bus/") and path != "splitbus/bus/core/keys.py":
            names = ", ".join(f"`{MEMBERS[n]}`" for n in sorted({n for _, n in uses}))
            lines.append(f"| `{path}` | {names} | ... | ... |")
    return "\n".join(lines)


def test_docs_name_one_owner_per_key_and_every_bus_module_that_touches_one() -> None:
    table = _owner_table()
    used = {
        path: {MEMBERS[name] for _, name in uses}
        for path, uses in _uses_by_file().items()
        if path.startswith("splitbus/bus/") and path != "splitbus/bus/core/keys.py"
    }
    hint = f"docs/bus.md's owner table must list (owns | also touches):\n{_expected_rows()}"
    assert {path: owns | touches for path, (owns, touches, _) in table.items()} == used, hint
    owned = [key for owns, _, _ in table.values() for key in owns]
    assert sorted(owned) == sorted(MEMBERS.values()), "every key has exactly one owner"


def test_docs_name_the_scripts_each_owner_runs() -> None:
    for module in pkgutil.walk_packages(splitbus.bus.__path__, "splitbus.bus."):
        importlib.import_module(module.name)
    declared: dict[str, set[str]] = {}
    for script in SCRIPTS.values():
        declared.setdefault("splitbus/" + script.module.removeprefix("splitbus.").replace(".", "/") + ".py", set()).add(
            script.name
        )
    listed = {path: scripts for path, (_, _, scripts) in _owner_table().items() if scripts}
    assert listed == declared
