"""`splitbus tenants` as an operator runs it, on a real Redis: add prints a generated key once, on
its last line, and Redis keeps only its digest; list shows no key; set and rm; a key of one's own
comes on stdin, never in argv; a bad value or name is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.tenants import Tenant, TenantLimits, TenantStore, key_digest

SPLITBUS = [sys.executable, "-m", "splitbus.cli.main", "tenants"]


def _tenants(config: BusConfig, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPLITBUS_REDIS_URL": config.redis_url, "SPLITBUS_PREFIX": config.prefix}
    return subprocess.run([*SPLITBUS, *args], env=env, input=stdin, capture_output=True, text=True, timeout=60)


async def test_add_prints_the_key_once_on_its_last_line_and_list_shows_none(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    added = _tenants(bus_config, "add", "acme", "--rps", "5", "--tpm", "100000", "--concurrency", "8")
    assert added.returncode == 0, added.stdout + added.stderr
    key = added.stdout.splitlines()[-1]
    assert key.startswith("sb-") and len(key) == 46 and added.stdout.count(key) == 1 and key not in added.stderr
    store = TenantStore(redis, bus_config.keys)
    acme = await store.by_key(key.encode())
    assert acme is not None and acme.limits == TenantLimits(rps=5, tpm=100_000, concurrency=8)
    listed = _tenants(bus_config, "list")
    assert listed.returncode == 0 and key not in listed.stdout and key_digest(key) not in listed.stdout
    assert listed.stdout.splitlines()[1].split() == ["acme", "1", "5", "100000", "-", "-", "8", "0", "1"]
    as_json = json.loads(_tenants(bus_config, "list", "--json").stdout)
    assert as_json == {
        "tenants": [{"name": "acme", "keys": 1, "rps": 5, "tpm": 100000, "concurrency": 8, "priority": 0, "weight": 1}],
        "invalid": [],
    }


async def test_a_key_of_ones_own_comes_on_stdin_and_is_not_echoed(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    key = "sk-operators-own-key-0123456789"
    added = _tenants(bus_config, "add", "beta", "--priority", "-1", "--weight", "2", "--key-stdin", stdin=key + "\n")
    assert added.returncode == 0, added.stdout + added.stderr
    assert key not in added.stdout + added.stderr
    beta = await TenantStore(redis, bus_config.keys).by_key(key.encode())
    assert beta is not None and (beta.name, beta.limits) == ("beta", TenantLimits(priority=-1, weight=2))
    short = _tenants(bus_config, "key", "beta", "--key-stdin", stdin="short\n")
    assert short.returncode == 2 and "16 to 256 visible ASCII" in short.stdout
    in_argv = _tenants(bus_config, "add", "gamma", "--key", "sk-in-argv-0123456789")
    assert in_argv.returncode == 2 and await TenantStore(redis, bus_config.keys).get("gamma") is None


async def test_set_changes_and_lifts_limits_and_rm_takes_the_keys(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    store = TenantStore(redis, bus_config.keys)
    await store.add(Tenant("acme", limits=TenantLimits(rps=1, concurrency=2)), (key_digest("sk-acme-0123456789"),))
    changed = _tenants(bus_config, "set", "acme", "--rps", "none", "--output-tpm", "500")
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert (await store.get("acme")).limits == TenantLimits(output_tpm=500, concurrency=2)  # type: ignore[union-attr]
    second = _tenants(bus_config, "key", "acme")
    assert second.returncode == 0 and await store.by_key(second.stdout.splitlines()[-1].encode()) is not None
    removed = _tenants(bus_config, "rm", "acme")
    assert removed.returncode == 0 and "with its 2 API key(s)" in removed.stdout
    assert await store.all() == [] and await store.key_counts() == {}
    again = _tenants(bus_config, "rm", "acme")
    assert again.returncode == 1 and "no tenant named acme" in again.stdout


def test_bad_values_and_names_are_refused_before_anything_is_written(bus_config: BusConfig) -> None:
    for args, error in [
        (("add", "a b"), "a tenant's name is 1 to 64"),
        (("add", "acme", "--weight", "0"), "weight must be in"),
        (("set", "acme"), "nothing to change"),
    ]:
        refused = _tenants(bus_config, *args)
        assert refused.returncode == 2 and error in refused.stdout, refused.stdout
    assert _tenants(bus_config, "list").stdout.strip() == "no tenants"
