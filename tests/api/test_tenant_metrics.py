"""The refusals' log, once per reason per interval (pure logic; the live labels are checked in
tests/api/test_tenant_limits.py)."""

from __future__ import annotations

import logging

import pytest

from splitbus.api import metrics
from splitbus.api.metrics import REFUSALS_LOG_EVERY_S, Refusals


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
