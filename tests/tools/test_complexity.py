"""tools/complexity.py, the complexity gate of `make check`: it fails on a function, a method, a
closure or a nested class's method over 10 by radon's count (boolean operators included), and
never on a class whose methods are each within it."""

from __future__ import annotations

from pathlib import Path

from tools.complexity import main, offenders

# Eleven: one, plus ten `if`s, or one `if` and nine boolean operators.
ELEVEN_IFS = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(10))
ELEVEN_BOOLS = "    if " + " and ".join(f"x != {i}" for i in range(10)) + ":\n        return 1\n"
TEN_IFS = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(9))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sample.py"
    path.write_text(text)
    return path


def test_a_function_over_ten_fails(tmp_path: Path) -> None:
    path = _write(tmp_path, f"def eleven(x):\n{ELEVEN_IFS}\ndef ten(x):\n{TEN_IFS}")
    assert offenders(path) == [f"{path}:1 eleven (11)"]
    assert main([str(tmp_path)]) == 1


def test_boolean_operators_count(tmp_path: Path) -> None:
    path = _write(tmp_path, f"def eleven(x):\n{ELEVEN_BOOLS}")
    assert offenders(path) == [f"{path}:1 eleven (11)"]


def test_methods_closures_and_nested_classes_count(tmp_path: Path) -> None:
    method = "".join("    " + line + "\n" for line in f"def eleven(self, x):\n{ELEVEN_IFS}".splitlines())
    nested = "".join("    " + line + "\n" for line in f"class Inner:\n{method}".splitlines())
    closure = "".join("    " + line + "\n" for line in f"def inner(x):\n{ELEVEN_IFS}".splitlines())
    text = f"class Outer:\n{method}\n{nested}\n\ndef outer():\n{closure}    return inner\n"
    path = _write(tmp_path, text)
    assert sorted(line.split(" ", 1)[1] for line in offenders(path)) == [
        "Inner.eleven (11)",
        "Outer.eleven (11)",
        "inner (11)",
    ]


def test_a_class_of_small_methods_passes(tmp_path: Path) -> None:
    # radon grades this class 11 (its methods' average, 10, plus one) and xenon fails it: not a function.
    methods = "".join("    " + line + "\n" for n in range(3) for line in f"def m{n}(self, x):\n{TEN_IFS}".splitlines())
    path = _write(tmp_path, f"class Many:\n{methods}")
    assert offenders(path) == []
    assert main([str(path)]) == 0
