"""The block hash: splitbus's one name for a full KV block, the same in every engine and process.

A block of ``block_size`` tokens is named by a chained hash of its parent's hash (the block
before it; ``ROOT`` for the first), its token ids and an extra key for anything else that
changes its KV (the model, its dtype). Two sequences share a block's hash exactly when they
share every token up to its end, so a hash names a whole prefix. It is blake2b (16 bytes, as an
unsigned int), never Python's ``hash()``, whose seed differs per process: workers, schedulers
and benchmarks compute the same hashes. 128 bits, because a collision hands one sequence another's
KV: 64 bits collide by the birthday bound near 2**32 blocks, within a large fleet's lifetime;
128 bits near 2**64. Only full blocks are hashed: a partial block's KV is still being written.

A request's chain may be salted (``GenerateRequest.cache_salt``; docs/routing.md, "Salted
chains"): the salt is its first block's parent instead of ``ROOT``, so every block of the chain
differs from an unsalted or otherwise salted one, and requests share KV only within a salt.
Pure: no paddle, no Redis.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = 0
"""The parent hash of an unsalted sequence's first block."""
_DIGEST = 16


def root_of(salt: str) -> int:
    """The parent of a chain's first block: ``ROOT`` for no salt (""), else the salt itself, a
    ``HEX_DIGITS`` hex string (``GenerateRequest.cache_salt``, already checked by the bus)."""
    return int(salt, 16) if salt else ROOT


def block_hash(parent: int, tokens: Sequence[int], extra: str = "") -> int:
    """The hash of one full block: ``parent``'s hash, the block's ``tokens``, ``extra``."""
    h = hashlib.blake2b(digest_size=_DIGEST, key=extra.encode()[:64])
    h.update(parent.to_bytes(_DIGEST, "little"))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, extra: str = "", parent: int = ROOT) -> list[int]:
    """The chained hashes of the full blocks of ``tokens`` (a trailing partial block has none):
    ``block_hash`` of each, with the tokens packed once for the whole sequence (a third faster)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    count = len(tokens) // block_size
    if count == 0:
        return []
    packed = struct.pack(f"<{count * block_size}q", *tokens[: count * block_size])
    step, key, blake2b = block_size * 8, extra.encode()[:64], hashlib.blake2b
    hashes: list[int] = []
    for start in range(0, count * step, step):
        h = blake2b(parent.to_bytes(_DIGEST, "little"), digest_size=_DIGEST, key=key)
        h.update(packed[start : start + step])
        parent = int.from_bytes(h.digest(), "little")
        hashes.append(parent)
    return hashes


HEX_DIGITS = 2 * _DIGEST
"""A block hash as events and requests carry it: 32 lowercase hex digits."""
HEX_FORMAT = f"0{HEX_DIGITS}x"
"""``format`` spec of a block hash (or salt) as ``HEX_DIGITS`` digits."""


def chain_hex(tokens: Sequence[int], block_size: int, extra: str = "", salt: str = "") -> str:
    """``block_hashes`` of ``tokens``, salted with ``salt`` (``root_of``), as one string,
    ``HEX_DIGITS`` per block (what a request carries in ``prefix_hashes``)."""
    return "".join(format(h, HEX_FORMAT) for h in block_hashes(tokens, block_size, extra, root_of(salt)))


def split_hex(chain: str) -> list[str]:
    """A ``chain_hex`` string as the list of its blocks' hashes."""
    return [chain[i : i + HEX_DIGITS] for i in range(0, len(chain), HEX_DIGITS)]
