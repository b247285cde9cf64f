"""Per-tenant metrics' bounds and the refusals' log (pure logic; the live labels are checked in
tests/api/test_tenant_limits.py)."""

from __future__ import annotations

import logging

import pytest

from splitbus.api import metrics
from splitbus.api.metrics import OTHER_TENANT, REFUSALS_LOG_EVERY_S, Refusals, TenantLabels


def test_tenant_labels_are_capped_and_the_rest_are_other() -> None:
    labels = TenantLabels(cap=3)
    seen = [labels(name) for name in ("a", "", "b", "c", "d", "a", "c")]
    assert seen == ["a", "default", "b", OTHER_TENANT, OTHER_TENANT, "a", OTHER_TENANT]
    assert labels("b") == "b"  # a name seen before keeps its label


def test_the_cap_holds_however_many_tenants_come() -> None:
    labels = TenantLabels(cap=100)
    assert len({labels(f"t{i}") for i in range(10_000)}) == 101  # 100 names and OTHER_TENANT


def test_refusals_are_logged_once_per_reason_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    refusals = Refusals(clock=lambda: clock[0])
    before = metrics.TENANT_REQUESTS.labels("logtest", "requests")._value.get()
    with caplog.at_level(logging.WARNING, logger="splitbus.api.metrics"):
        for _ in range(5):
            refusals.add("logtest", "requests", "at their tenant's requests per second")
        refusals.add("logtest", "concurrency", "at their tenant's concurrent requests")  # its own reason: logged
        clock[0] = REFUSALS_LOG_EVERY_S / 2
        refusals.add("logtest2", "requests", "at their tenant's requests per second")
        clock[0] = REFUSALS_LOG_EVERY_S
        refusals.add("logtest", "requests", "at their tenant's requests per second")
    assert [r.getMessage() for r in caplog.records] == [
        "refused 1 request (requests) at their tenant's requests per second; tenants: logtest",
        "refused 1 request (concurrency) at their tenant's concurrent requests; tenants: logtest",
        "refused 6 requests (requests) at their tenant's requests per second; tenants: logtest, logtest2",
    ]
    assert metrics.TENANT_REQUESTS.labels("logtest", "requests")._value.get() - before == 6
