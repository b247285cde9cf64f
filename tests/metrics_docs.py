"""docs/metrics.md's catalog as data, for the tests that check names against it (the code's
metrics, the dashboard's queries, the Kubernetes example's rules)."""

from __future__ import annotations

import re
from pathlib import Path

CATALOG = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each metric listed in a catalog table: name -> (type, label names)."""
    rows = re.findall(r"^\| `(splitbus_\w+)` \| (\w+) \| ([^|]+) \|", CATALOG.read_text(), re.MULTILINE)
    return {name: (kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
