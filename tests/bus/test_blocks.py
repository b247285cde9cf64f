"""The block hash: chained, 128 bits, deterministic across processes, full blocks only, salted per chain."""

from __future__ import annotations

import subprocess
import sys

from splitbus.bus.blocks import HEX_DIGITS, ROOT, block_hash, block_hashes, chain_hex, root_of, split_hex
from splitbus.bus.messages.kv_events import block_hash as kv_block_hash


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


def test_a_hash_is_128_bits_and_written_as_32_hex_digits() -> None:
    """64-bit hashes collide by the birthday bound near 2**32 blocks (a collision reuses another
    sequence's KV); 128 bits push that to 2**64."""
    hashes = block_hashes(list(range(64 * 16)), 16)
    assert all(0 <= h < 2**128 for h in hashes)
    assert any(h >= 2**64 for h in hashes)  # all under 2**64 by chance: 2**-64 a block
    chain = chain_hex(list(range(64 * 16)), 16)
    assert HEX_DIGITS == 32 and len(chain) == 64 * 32
    assert split_hex(chain) == [kv_block_hash(h) for h in hashes] == [format(h, "032x") for h in hashes]
    # the parent is hashed whole: two parents that agree in their low 64 bits give two children
    assert block_hash(2**64 + 5, range(16)) != block_hash(5, range(16))


def test_a_salt_changes_every_block_of_the_chain() -> None:
    tokens = list(range(100))
    plain = block_hashes(tokens, 16)
    salt, other = "0f" * 16, "e1" * 16
    salted = block_hashes(tokens, 16, parent=root_of(salt))
    assert root_of("") == ROOT and chain_hex(tokens, 16, salt="") == chain_hex(tokens, 16)
    assert not set(salted) & set(plain)
    assert not set(salted) & set(block_hashes(tokens, 16, parent=root_of(other)))
    assert salted == block_hashes(tokens, 16, parent=root_of(salt))  # the same salt: the same chain
    assert split_hex(chain_hex(tokens, 16, salt=salt)) == [kv_block_hash(h) for h in salted]
    assert salted[0] == block_hash(root_of(salt), tokens[:16])  # the salt is the first block's parent
