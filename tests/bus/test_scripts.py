"""Every Lua script is declared in the bus module that owns its keys, builds no key name, stays in
one hash slot (what Redis Cluster needs), and is listed, as declared, in docs/bus.md's script
table. That every script the suite runs is called with keys of one slot is checked on each
command sent (``one_slot_per_command`` in tests/conftest.py)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import redis.asyncio as aioredis

import splitbus
import splitbus.bus
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import Keys
from splitbus.bus.core.scripts import SCRIPTS, LuaScript, lua_string
from splitbus.bus.registry import LogOp
from tests.bus.slots import key_names, keys_of, sample, slots, watch_slots

ROOT = Path(splitbus.__file__).parent
DOCS = ROOT.parent / "docs" / "bus.md"


def _import_bus() -> dict[str, LuaScript]:
    for module in pkgutil.walk_packages(splitbus.bus.__path__, "splitbus.bus."):
        importlib.import_module(module.name)
    return dict(SCRIPTS)


def _lua_in_sources() -> dict[str, str]:
    """Every string literal in splitbus that runs Redis commands, as a pattern of its text (an
    f-string's replacement fields, the names a script takes from Python, match any text), and its
    module."""
    found = {}
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        in_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
        for node in ast.walk(tree):
            text = _text(node) if id(node) not in in_fstrings else None
            if text is not None and "redis.call(" in text:
                found[_pattern(node)] = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    return found


def _text(node: ast.AST) -> str | None:
    """A string literal's text (an f-string's without its replacement fields); None: no literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value for part in node.values if isinstance(part, ast.Constant))
    return None


def _pattern(node: ast.AST) -> str:
    if isinstance(node, ast.JoinedStr):
        return "".join(re.escape(p.value) if isinstance(p, ast.Constant) else ".+?" for p in node.values)
    assert isinstance(node, ast.Constant)
    return re.escape(node.value)


def _tag(key: str) -> str:
    """What Redis Cluster hashes a key by: its hash tag, or the whole name without one."""
    tag = re.search(r"\{[^}]*\}", key)
    return tag.group(0) if tag else key


def _alternatives(keys: tuple[str, ...]) -> list[str]:
    return [alt for key in keys for alt in key.split(" | ")]


def _slots(script: LuaScript) -> str:
    """The hash slots one run touches: ``one``, ``one (`{tag}`)`` where its keys share a tag, or
    ``many`` (a cross-slot script)."""
    if len(script.keys) == 1 and not script.repeated:
        return "one"
    tags = {_tag(key) for key in _alternatives((*script.keys, *script.repeated))}
    return f"one (`{tags.pop()}`)" if len(tags) == 1 else "many"


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
    for pattern, module in _lua_in_sources().items():
        sources = [source for source in declared if re.fullmatch(pattern, source, re.DOTALL)]
        assert sources, f"a Lua script in {module} is not declared (splitbus.bus.core.scripts.declare)"
        assert declared[sources[0]].module == module
        assert module.startswith("splitbus.bus."), f"{declared[sources[0]].name}: scripts live in bus/, not {module}"


@pytest.mark.parametrize("name", sorted(_import_bus()))
def test_a_script_builds_no_key_name_and_touches_only_declared_keys(name: str) -> None:
    script, known = SCRIPTS[name], set(key_names().values())
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


SAMPLE_IDS = [
    {"worker": "prefill-0", "request": "cmpl-7f3a", "reader": "api-1a2b.out.0", "tenant": "acme"},
    {"worker": "decode-3", "request": "cmpl-0c9e:1796121154658-0", "reader": "api-1a2b.out.0", "tenant": "acme"},
    {"worker": "dp-g0-r1", "request": "chatcmpl-42", "reader": "api-1a2b.out.0", "tenant": "acme"},
]
"""Ids for the keys of one run: several workers and requests (a dispatch's tasks, a snapshot's
workers, a step's requests) of one cell, and one reader shard (what one write_step covers)."""


@pytest.mark.parametrize("name", sorted(_import_bus()))
@pytest.mark.parametrize("cell", ["main", "eu-west.2"])
def test_the_keys_a_script_is_called_with_lie_in_one_slot(name: str, cell: str) -> None:
    script, keys = SCRIPTS[name], Keys(cell=cell)
    names = [sample(k, keys, SAMPLE_IDS[0]) for k in _alternatives(script.keys)]
    names += [sample(k, keys, ids) for ids in SAMPLE_IDS for k in _alternatives(script.repeated)]
    assert len(slots(names)) == 1, f"{name}: {names} span slots {slots(names)}"


@pytest.mark.parametrize(
    ("command", "keys"),
    [
        (
            ["EVALSHA", "f00", 2, "sb:kv:{main}:r", "sb:current:{main}:r", "a", 1],
            [b"sb:kv:{main}:r", b"sb:current:{main}:r"],
        ),
        ([b"EVAL", b"return 1", b"0"], []),
        (["XREAD", "COUNT", 5, "BLOCK", 1000, "STREAMS", "a", "b", "0-0", "0-0"], [b"a", b"b"]),
        (["XREADGROUP", "GROUP", "g", "c", "COUNT", 1, "streams", "s", ">"], [b"s"]),
        (["XADD", "sb:out:{x}:r", "*", "type", "token"], None),
    ],
)
def test_the_slot_check_finds_the_keys_a_command_must_keep_in_one_slot(
    command: list[object], keys: list[bytes] | None
) -> None:
    assert keys_of(command) == keys


def test_the_slot_check_tells_a_cross_slot_script() -> None:
    cross = ["EVALSHA", "f00", 2, "sb:out:{api-1.out.0}:r1", "sb:out:{api-2.out.0}:r2"]
    assert len(slots(keys_of(cross) or [])) == 2


async def test_the_wire_check_sees_what_a_single_redis_lets_cross_slots(
    redis: aioredis.Redis, bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single Redis runs a script or an XREAD over keys in many slots, and redis-py 8.2's
    cluster pipeline takes ``pipe.evalsha``, which 8.1 refused: the suite-wide check on the wire
    (``one_slot_per_command``) is what finds such a command, in a pipeline (the Batcher's and the
    ResultWriter's way) as in a plain call. Each is recorded as it is packed."""
    crossing = watch_slots(monkeypatch)  # this test's own record, so the fixture's stays empty
    a, b = bus_config.keys.out("api-1", "r"), bus_config.keys.out("api-2", "r")
    assert len(slots([a, b])) == 2
    sha = await redis.script_load("return #KEYS")
    pipe = redis.pipeline(transaction=False)
    pipe.evalsha(sha, 2, a, b)
    pipe.execute_command("EVALSHA", sha, 2, a, b)
    assert await pipe.execute() == [2, 2]
    assert await redis.evalsha(sha, 2, a, b) == 2
    await redis.xadd(a, {"f": "1"})
    await redis.xadd(b, {"f": "1"})
    assert len(await redis.xread({a: "0", b: "0"})) == 2
    assert crossing == [[a.encode(), b.encode()]] * 4


def test_a_name_python_defines_is_spelled_in_a_script_as_a_plain_lua_string() -> None:
    names = ("w", "+reserved_kv_blocks", LogOp.BEAT)
    assert [lua_string(name) for name in names] == ["'w'", "'+reserved_kv_blocks'", "'beat'"]
    for bad in ("", "a'b", "sb:k", "a b", "x\\"):
        with pytest.raises(ValueError, match="not a plain field name"):
            lua_string(bad)
