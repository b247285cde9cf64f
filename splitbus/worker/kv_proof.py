"""What proves a KV frame comes from the holder of its reservation's secret, and the frame's
header a receiver checks it on before it reads the payload (``splitbus.worker.transfer`` reads
and writes the frames). No I/O: the worker's core checks a frame here (``WorkerCore.admit_kv``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

PROOF_CONTEXT = "splitbus-kv-proof-v1"


@dataclass(frozen=True)
class Header:
    """A frame without its payload: all a receiver checks before it reads the payload."""

    kind: int
    ident: str
    meta: dict[str, Any]
    size: int
    crc: int


def new_secret() -> str:
    """A reservation's secret: 256 random bits, hex."""
    return secrets.token_hex(32)


def kv_proof(secret: str, sender: str, ident: str, meta: Mapping[str, Any], size: int, crc: int) -> str:
    """What proves a KV frame comes from the holder of ``secret``: an HMAC over everything the
    frame claims. The meta is signed in a canonical form (sorted keys, without ``proof``), so
    the receiver recomputes it from the JSON it parsed. The payload is covered by its length
    and CRC, which the receiver checks against the bytes; hashing the bytes themselves (GiBs)
    would add to every transfer and guards only against someone on the path, whom the KV
    network is trusted to keep out (docs/security.md)."""
    signed = {k: v for k, v in meta.items() if k != "proof"}
    message = orjson.dumps([PROOF_CONTEXT, sender, ident, signed, size, crc], option=orjson.OPT_SORT_KEYS)
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def proof_matches(secret: str, sender: str, header: Header) -> bool:
    """Whether ``header`` carries the proof for ``secret`` (constant-time compare)."""
    claimed = header.meta.get("proof")
    if not secret or not isinstance(claimed, str):
        return False
    try:
        expected = kv_proof(secret, sender, header.ident, header.meta, header.size, header.crc)
    except orjson.JSONEncodeError:  # meta that parsed but cannot be signed (nested past orjson's 254 levels)
        return False
    return hmac.compare_digest(claimed.encode(), expected.encode())
