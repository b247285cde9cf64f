"""The complexity gate of `make check`: every function and method (closures and the methods of
nested classes too) at most MAX_COMPLEXITY by radon's count, which adds one per boolean operator
where ruff's mccabe check (C90) does not.

`radon cc` and xenon also grade classes, by the average of their methods plus one: that is no
function, so a class of many small methods would fail them; here only functions count.

    python -m tools.complexity splitbus      # exit 1 and one line per offender, else 0
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from radon.visitors import Class, ComplexityVisitor, Function

MAX_COMPLEXITY = 10


def functions(blocks: Iterable[Function | Class]) -> Iterator[Function]:
    """Every function below ``blocks``: methods, closures (radon does not add a closure's
    complexity to its function's, so each is graded alone) and nested classes' methods."""
    for block in blocks:
        if isinstance(block, Class):
            yield from functions([*block.methods, *block.inner_classes])
        else:
            yield block
            yield from functions(block.closures)


def offenders(path: Path, limit: int = MAX_COMPLEXITY) -> list[str]:
    """``path:line name (complexity)`` for each function of the file over ``limit``."""
    visitor = ComplexityVisitor.from_code(path.read_text())
    return [
        f"{path}:{f.lineno} {f.fullname} ({f.complexity})"
        for f in functions([*visitor.functions, *visitor.classes])
        if f.complexity > limit
    ]


def main(roots: list[str]) -> int:
    files = sorted(p for root in map(Path, roots) for p in ([root] if root.is_file() else root.rglob("*.py")))
    found = [line for path in files for line in offenders(path)]
    for line in found:
        print(line)
    print(f"{len(found)} functions over complexity {MAX_COMPLEXITY} in {len(files)} files (radon's count)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["splitbus"]))
