"""Tenants of the prefix cache (pure logic): a request's chain salt, from its key and cache_salt."""

from __future__ import annotations

from splitbus.api.tenants import NO_TENANT, cache_salt, tenant_of
from splitbus.bus.blocks import HEX_DIGITS


def test_without_keys_or_cache_salt_the_chain_is_unsalted() -> None:
    assert cache_salt(NO_TENANT, None) == ""


def test_each_key_and_cache_salt_has_a_salt_of_its_own_that_shows_neither() -> None:
    a, b = tenant_of("sk-a-0123456789"), tenant_of("sk-b-0123456789")
    salts = [cache_salt(t, s) for t in (NO_TENANT, a, b) for s in (None, "x", "y")][1:]
    assert len(set(salts)) == len(salts) == 8
    assert all(len(bytes.fromhex(s)) * 2 == len(s) == HEX_DIGITS for s in salts)
    assert cache_salt(a, "x") == cache_salt(tenant_of("sk-a-0123456789"), "x")  # the same across API replicas
    assert not any("0123456789" in s or a.hex() in s for s in salts)  # neither the key nor its tenant digest
