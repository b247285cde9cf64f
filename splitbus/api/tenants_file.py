"""``--tenants-file``: tenants written down for a deployment (compose, a config repository), put in
the tenant store when an API process starts (docs/tenants.md, "A tenants file").

The file is JSON and holds no secret: each key as its SHA-256 (``printf %s "$KEY" | sha256sum``)::

    {"tenants": {"acme": {"rps": 5, "tpm": 100000, "keys_sha256": ["<64 hex digits>"]}}}

For each tenant it lists, the store then has that tenant, with exactly the file's limits (one the
file leaves out: none) and at least the file's keys. Tenants and keys added with ``splitbus
tenants`` are left as they are. Every API node may read the same file at once: the store's
scripts make that safe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from splitbus.bus.tenants import (
    BadTenantRecord,
    Tenant,
    TenantError,
    TenantLimits,
    TenantStore,
    check_digest,
    check_name,
)

MAX_FILE_BYTES = 1 << 20
KEYS_FIELD = "keys_sha256"


@dataclass(frozen=True)
class FileTenant:
    """One tenant of a tenants file."""

    name: str
    limits: TenantLimits
    digests: tuple[str, ...]
    """The SHA-256 (hex) of each of its keys."""


def read_tenants_file(path: Path) -> tuple[FileTenant, ...]:
    """The tenants a file lists; ``ValueError`` naming the file, the tenant and the field for
    anything else (the API then does not start)."""
    try:
        raw = path.read_bytes()[: MAX_FILE_BYTES + 1]
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        listed = orjson.loads(raw).get("tenants") if raw.lstrip().startswith(b"{") else None
        if not isinstance(listed, dict):
            raise ValueError('not a JSON object with "tenants": {NAME: {...}, ...}')
        return tuple(_tenant(name, fields) for name, fields in listed.items())
    except (OSError, orjson.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"tenants file {path}: {exc}") from None


def _tenant(name: str, fields: object) -> FileTenant:
    try:
        if not isinstance(fields, dict):
            raise BadTenantRecord("not a JSON object")
        limits = {field: value for field, value in fields.items() if field != KEYS_FIELD}
        return FileTenant(check_name(name), TenantLimits.from_json(limits), _digests(fields.get(KEYS_FIELD, [])))
    except BadTenantRecord as exc:
        raise ValueError(f"tenant {name[:64]!r}: {exc}") from None


def _digests(listed: object) -> tuple[str, ...]:
    if not isinstance(listed, list) or not all(isinstance(digest, str) for digest in listed):
        raise BadTenantRecord(f"{KEYS_FIELD} must be a list of SHA-256 digests in hex")
    return tuple(check_digest(digest) for digest in listed)


async def seed(store: TenantStore, tenants: tuple[FileTenant, ...]) -> None:
    """Put the file's tenants in the store (see the module's docstring); ``TenantError`` when a key
    of the file is another tenant's."""
    for tenant in tenants:
        if not await _added(store, tenant):
            if tenant.digests:
                await store.add_keys(tenant.name, tenant.digests)
            await store.set(tenant.name, **asdict(tenant.limits))


async def _added(store: TenantStore, tenant: FileTenant) -> bool:
    """Add the tenant if there is none of its name: True if this added it. Another API node
    reading the same file may add it first (then False)."""
    if await store.get(tenant.name) is not None:
        return False
    try:
        await store.add(Tenant(tenant.name, limits=tenant.limits), tenant.digests)
    except TenantError:
        if await store.get(tenant.name) is None:
            raise  # not added by another node: a key of it is another tenant's
        return False
    return True
