"""The block hash: splitbus's one name for a full KV block, the same in every engine and process.

A block of ``block_size`` tokens is named by a chained hash of its parent's hash (the block
before it; ``ROOT`` for the first), its token ids and an extra key for anything else that
changes its KV (the model, its dtype). Two sequences share a block's hash exactly when they
share every token up to its end, so a hash names a whole prefix. It is blake2b (8 bytes, as an
unsigned int), never Python's ``hash()``, whose seed differs per process: workers, schedulers
and benchmarks compute the same hashes. Only full blocks are hashed: a partial block's KV is
still being written. Pure: no paddle, no Redis.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = 0
"""The parent hash of a sequence's first block."""
_DIGEST = 8


def block_hash(parent: int, tokens: Sequence[int], extra: str = "") -> int:
    """The hash of one full block: ``parent``'s hash, the block's ``tokens``, ``extra``."""
    h = hashlib.blake2b(digest_size=_DIGEST, key=extra.encode()[:64])
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, extra: str = "", parent: int = ROOT) -> list[int]:
    """The chained hashes of the full blocks of ``tokens`` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
