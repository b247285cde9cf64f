"""The scheduler's per-tenant queued gauge (pure logic, on a registry of its own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from splitbus.placement.metrics import OTHER_TENANT, TenantLabels
from splitbus.scheduler.metrics import QueuedByTenant


def test_the_queued_gauge_counts_each_tenant_and_zeroes_one_that_left() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("queued", "test", ["tenant"], registry=registry)
    queued = QueuedByTenant(gauge, TenantLabels(cap=2))

    def value(tenant: str) -> float | None:
        return registry.get_sample_value("queued", {"tenant": tenant})

    queued.show(["a", "a", "b", "", "c"])  # "" is the default tenant, past the cap of 2 with "c"
    assert [value(t) for t in ("a", "b", OTHER_TENANT, "default", "c")] == [2, 1, 2, None, None]
    queued.show(["b"])
    assert [value(t) for t in ("a", "b", OTHER_TENANT)] == [0, 1, 0]
