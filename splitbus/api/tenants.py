"""Tenants of the prefix cache: who may reuse whose cached KV (docs/security.md, "The prefix
cache is shared only within a tenant").

Every API key is a tenant; with no keys configured everyone is one tenant. A request's hash chain
is salted (``GenerateRequest.cache_salt``) with a digest of its tenant and of the body's optional
``cache_salt`` (vLLM's field), so a request reuses only the KV of requests with the same tenant and
the same ``cache_salt``: another tenant's prompt can no longer show through ``cached_tokens`` or
the time to the first token. The key never reaches the bus: only a digest of a digest of it does.
Pure: no Redis.
"""

from __future__ import annotations

import hashlib

from splitbus.bus.blocks import HEX_DIGITS

NO_TENANT = b""
"""The tenant of every request when no API keys are configured."""
_DIGEST = HEX_DIGITS // 2


def tenant_of(api_key: str) -> bytes:
    """The tenant an API key names: a digest of it (what the API keeps of it per request, and
    salts with), not the key."""
    return hashlib.blake2b(api_key.encode(), digest_size=_DIGEST, person=b"sb-tenant").digest()


def cache_salt(tenant: bytes, salt: str | None) -> str:
    """The salt of a request's hash chain (``GenerateRequest.cache_salt``): "" (unsalted, as before
    tenants) for no tenant and no ``salt``, else ``HEX_DIGITS`` hex digits of a digest of both.
    The tenant's digest is of a fixed length (or empty, with its length first), so no choice of
    ``salt`` by one tenant reproduces another's input."""
    if tenant == NO_TENANT and salt is None:
        return ""
    h = hashlib.blake2b(digest_size=_DIGEST, person=b"sb-cache-salt")
    h.update(bytes([len(tenant)]) + tenant)
    h.update(b"\x00" if salt is None else b"\x01" + salt.encode())
    return h.hexdigest()
