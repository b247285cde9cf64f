"""Every Lua script is declared in the bus module that owns its keys, builds no key name, and is
listed, as declared, in docs/bus.md's script table (what Redis Cluster support will need)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import splitbus
import splitbus.bus
from splitbus.bus.keys import Keys
from splitbus.bus.scripts import SCRIPTS, LuaScript

ROOT = Path(splitbus.__file__).parent
DOCS = ROOT.parent / "docs" / "bus.md"


def _import_bus() -> dict[str, LuaScript]:
    for module in pkgutil.walk_packages(splitbus.bus.__path__, "splitbus.bus."):
        importlib.import_module(module.name)
    return dict(SCRIPTS)


def _lua_in_sources() -> dict[str, str]:
    """Every string literal in splitbus that runs Redis commands: its text, and its module."""
    found = {}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "redis.call(" in node.value:
                found[node.value] = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    return found


def _key_names() -> set[str]:
    """Every key name keys.py builds, as docs/bus.md writes it: each argument named by its
    parameter (``kv(request)`` -> ``sb:kv:{request}``)."""
    keys, names = Keys(), set()
    for name, member in inspect.getmembers(Keys):
        if isinstance(member, property):
            names.add(getattr(keys, name))
        elif inspect.isfunction(member) and not name.startswith("_") and name != "kind":
            params = list(inspect.signature(member).parameters)[1:]
            names.add(getattr(keys, name)(*params))
    return names


def _tag(key: str) -> str:
    """What Redis Cluster hashes a key by: its hash tag, or the whole name without one."""
    tag = re.search(r"\{[^}]*\}", key)
    return tag.group(0) if tag else key


def _slots(script: LuaScript) -> str:
    """The hash slots one run touches: ``one`` (the tag) or ``many`` (a cross-slot script)."""
    if len(script.keys) == 1 and not script.repeated:
        return "one"
    tags = {_tag(alt) for key in script.keys for alt in key.split(" | ")}
    return f"one (`{tags.pop()}`)" if len(tags) == 1 and not script.repeated else "many"


def _row(script: LuaScript) -> str:
    def named(key: str) -> str:
        return " or ".join(f"`{alt}`" for alt in key.split(" | "))

    keys = ", ".join(named(k) for k in script.keys)
    if script.repeated:
        keys += ("; then, " if keys else "") + "per item: " + ", ".join(named(k) for k in script.repeated)
    module = script.module.replace(".", "/") + ".py"
    return f"| `{script.name}` | `{module}` | {keys} | {_slots(script)} | {script.argv} | {script.returns} |"


def test_every_script_in_splitbus_is_declared_in_the_bus_module_it_lives_in() -> None:
    declared = {script.source: script for script in _import_bus().values()}
    for source, module in _lua_in_sources().items():
        assert source in declared, f"a Lua script in {module} is not declared (splitbus.bus.scripts.declare)"
        assert declared[source].module == module
        assert module.startswith("splitbus.bus."), f"{declared[source].name}: scripts live in bus/, not {module}"


@pytest.mark.parametrize("name", sorted(_import_bus()))
def test_a_script_builds_no_key_name_and_touches_only_declared_keys(name: str) -> None:
    script, known = SCRIPTS[name], _key_names()
    assert ".." not in script.source, "builds a string (a key name?) in Lua: pass the key in KEYS"
    assert not re.search(r"'[^']*:[^']*'", script.source), "a key name in the script's text"
    assert not re.search(r"redis\.call\('\w+',\s*ARGV", script.source), "a key taken from ARGV"
    for key in [alt for k in (*script.keys, *script.repeated) for alt in k.split(" | ")]:
        assert key in known, f"{key} is not a key keys.py builds"
    if not script.repeated:
        used = {int(i) for i in re.findall(r"KEYS\[(\d+)\]", script.source)}
        assert used == set(range(1, len(script.keys) + 1)), f"uses KEYS {sorted(used)}, declares {len(script.keys)}"


def test_the_script_table_in_docs_bus_md_is_the_declared_scripts() -> None:
    page = DOCS.read_text()
    table = page.split("\n## Scripts\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    expected = [_row(s) for s in sorted(_import_bus().values(), key=lambda s: (s.module, s.name))]
    assert rows == expected, "\n".join(["docs/bus.md's script table should read:", *expected])
