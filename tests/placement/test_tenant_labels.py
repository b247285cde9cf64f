"""Tenant labels of the per-tenant metrics (the API's and the scheduler's): bounded."""

from __future__ import annotations

from splitbus.placement.metrics import OTHER_TENANT, TenantLabels


def test_tenant_labels_are_capped_and_the_rest_are_other() -> None:
    labels = TenantLabels(cap=3)
    seen = [labels(name) for name in ("a", "", "b", "c", "d", "a", "c")]
    assert seen == ["a", "default", "b", OTHER_TENANT, OTHER_TENANT, "a", OTHER_TENANT]
    assert labels("b") == "b"  # a name seen before keeps its label


def test_the_cap_holds_however_many_tenants_come() -> None:
    labels = TenantLabels(cap=100)
    assert len({labels(f"t{i}") for i in range(10_000)}) == 101  # 100 names and OTHER_TENANT
