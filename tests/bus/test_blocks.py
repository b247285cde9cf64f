"""The block hash: chained, deterministic across processes, full blocks only."""

from __future__ import annotations

import subprocess
import sys

from splitbus.bus.blocks import ROOT, block_hash, block_hashes


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(31)), 16)) == 1
    assert len(block_hashes(list(range(32)), 16)) == 2
    assert block_hashes(list(range(15)), 16) == []


def test_the_hash_chains_its_parent() -> None:
    a, b = list(range(16)), list(range(16, 32))
    first, second = block_hashes(a + b, 16)
    assert first == block_hash(ROOT, a)
    assert second == block_hash(first, b)
    # the same block after another prefix is another block
    assert block_hashes(b + b, 16)[1] != second
    assert block_hash(ROOT, a, extra="other-model") != first


def test_the_hash_is_the_same_in_another_process() -> None:
    code = "from splitbus.bus.blocks import block_hashes; print(block_hashes(list(range(40)), 8, 'm'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(block_hashes(list(range(40)), 8, "m"))
