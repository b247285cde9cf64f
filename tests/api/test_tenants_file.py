"""``--tenants-file``: what a file may say (bad ones named and refused before the API starts), and
what seeding it does to the store, on a real Redis: its tenants with exactly its limits and at
least its keys, others left alone, every API node at once."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from splitbus.api.tenants_file import FileTenant, read_tenants_file, seed
from splitbus.bus.core.config import BusConfig
from splitbus.bus.tenants import Tenant, TenantError, TenantLimits, TenantStore, key_digest

ACME_KEY, BETA_KEY = "sk-acme-0123456789abcdef", "sk-beta-0123456789abcdef"


def _file(tmp_path: Path, tenants: object) -> Path:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def test_a_file_lists_tenants_their_limits_and_their_keys_digests(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        {
            "acme": {"rps": 5, "tpm": 100000, "concurrency": 8, "keys_sha256": [key_digest(ACME_KEY)]},
            "beta": {"priority": -1, "weight": 2},
        },
    )
    assert read_tenants_file(path) == (
        FileTenant("acme", TenantLimits(rps=5, tpm=100_000, concurrency=8), (key_digest(ACME_KEY),)),
        FileTenant("beta", TenantLimits(priority=-1, weight=2), ()),
    )


@pytest.mark.parametrize(
    ("tenants", "error"),
    [
        ([], 'not a JSON object with "tenants"'),
        ({"a b": {}}, "a tenant's name is"),
        ({"acme": []}, "tenant 'acme': not a JSON object"),
        ({"acme": {"rps": -1}}, "tenant 'acme': rps must be in"),
        ({"acme": {"key": ACME_KEY}}, "tenant 'acme': unknown tenant field(s): 'key'"),
        ({"acme": {"keys_sha256": ACME_KEY}}, "keys_sha256 must be a list"),
        ({"acme": {"keys_sha256": [ACME_KEY]}}, "a key's SHA-256 is 64 lower-case hex digits, got 'sk-acme"),
    ],
)
def test_a_bad_file_is_refused_naming_the_tenant_and_field(tmp_path: Path, tenants: object, error: str) -> None:
    with pytest.raises(ValueError, match=f"tenants file {tmp_path}.*{re.escape(error)}"):
        read_tenants_file(_file(tmp_path, tenants))


def test_a_file_that_is_not_json_or_not_there_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("tenants = 1")
    for path in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(ValueError, match=f"tenants file {path}"):
            read_tenants_file(path)


async def test_seeding_sets_the_files_tenants_and_leaves_the_rest(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    store = TenantStore(redis, bus_config.keys)
    await store.add(Tenant("acme", limits=TenantLimits(rps=1, output_tpm=9)), (key_digest("sk-acme-added-by-cli"),))
    await store.add(Tenant("other"))
    listed = (
        FileTenant("acme", TenantLimits(tpm=500), (key_digest(ACME_KEY),)),
        FileTenant("beta", TenantLimits(concurrency=2), (key_digest(BETA_KEY),)),
    )
    await asyncio.gather(seed(store, listed), seed(store, listed))  # two API nodes starting at once
    await seed(store, listed)  # and a restart
    acme, beta = await store.by_key(ACME_KEY.encode()), await store.by_key(BETA_KEY.encode())
    assert acme is not None and acme.limits == TenantLimits(tpm=500)  # exactly the file's
    assert beta is not None and beta.limits == TenantLimits(concurrency=2)
    assert await store.by_key(b"sk-acme-added-by-cli") == acme
    assert await store.key_counts() == {"acme": 2, "beta": 1}
    assert [t.name for t in await store.all() if isinstance(t, Tenant)] == ["acme", "beta", "other"]


async def test_a_files_key_that_is_another_tenants_stops_the_start(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    store = TenantStore(redis, bus_config.keys)
    await store.add(Tenant("acme"), (key_digest(ACME_KEY),))
    await store.add(Tenant("beta"))
    taken = (key_digest(ACME_KEY),)
    with pytest.raises(TenantError, match="another tenant's"):
        await seed(store, (FileTenant("beta", TenantLimits(), taken),))  # a tenant that exists
    with pytest.raises(TenantError, match="a tenant's already"):
        await seed(store, (FileTenant("gamma", TenantLimits(), taken),))  # a new one
    assert await store.get("gamma") is None and await store.key_counts() == {"acme": 1}


@pytest.mark.parametrize("command", ["api", "up"])
def test_a_bad_file_stops_the_api_or_up_before_it_starts(tmp_path: Path, tiny_model: Path, command: str) -> None:
    path = _file(tmp_path, {"acme": {"rps": "fast"}})
    args = [command, "--model", str(tiny_model), "--tenants-file", str(path), "--redis-url", "redis://127.0.0.1:1/0"]
    done = subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 2 and f"tenants file {path}: tenant 'acme': rps must be a number" in done.stdout
    assert not (tmp_path / ".splitbus").exists()  # up made nothing
