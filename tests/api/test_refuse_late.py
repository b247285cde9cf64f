"""Early refusal as an API process applies it (``ApiState.refuse_late``), with no Redis: a state
whose registry view holds a prefill worker with a deep queue and whose prefill rate is measured,
so that the prediction passes the deadline."""

from __future__ import annotations

import logging

import pytest

from splitbus.api import metrics
from splitbus.api.config import ApiConfig
from splitbus.api.errors import ServiceUnavailable
from splitbus.api.state import ApiState
from splitbus.bus.core.config import BusConfig
from splitbus.bus.records import Reserved, WorkerLoad
from splitbus.bus.registry import WorkerInfo, WorkerRecord

WAITING = 1000
"""The prefill worker's queue: at the measured 1 request/s, a predicted wait of 1000 s."""
UNUSED_REDIS = "redis://127.0.0.1:1/0"
"""Nothing here reaches Redis: the state's client connects only when used."""


def _prefill(done: int) -> WorkerInfo:
    load = WorkerLoad(waiting=WAITING, prefills_done=done)
    return WorkerInfo(WorkerRecord(worker_id="p", role="prefill", model="m", load=load), 0, 1000, Reserved())


def overloaded_state(timeout_s: float = 5, **config: object) -> ApiState:
    """An API state with a ``timeout_s`` request timeout whose fleet for model ``m`` starts
    1 request/s with ``WAITING`` waiting."""
    bus = BusConfig(redis_url=UNUSED_REDIS)
    state = ApiState(ApiConfig(bus=bus, models=(), request_timeout_s=timeout_s, **config), {})
    for at_s, done in ((0.0, 0), (10.0, 10)):  # 10 prefills in 10 s, requests waiting throughout
        state.workers.workers = [_prefill(done)]
        state.prefill_rates.observe(state.workers.live(), at_s)
    assert state.prefill_rates.rate("m") == 1.0
    return state


def test_a_request_predicted_to_wait_past_its_deadline_is_refused() -> None:
    with pytest.raises(ServiceUnavailable) as refused:
        overloaded_state().refuse_late("m")
    assert refused.value.code == "overloaded"
    assert refused.value.headers() == {"Retry-After": "60"}  # 995 s past it: the longest advice
    assert "past the 5s timeout" in str(refused.value)


def test_with_early_refusal_off_nothing_is_refused_and_the_rate_is_still_measured() -> None:
    state = overloaded_state(early_refusal=False)  # its rate measured: overloaded_state checks it
    state.refuse_late("m")


def test_an_early_refusal_is_counted_under_its_tenant_and_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics, "REFUSALS", metrics.Refusals())  # logged now, whatever refused before
    counted = metrics.TENANT_REQUESTS.labels("refuse-late", "overloaded")
    before = counted._value.get()
    with caplog.at_level(logging.WARNING, logger="splitbus.api.metrics"), pytest.raises(ServiceUnavailable):
        overloaded_state().refuse_late("m", "refuse-late")
    assert counted._value.get() - before == 1
    assert [r.getMessage() for r in caplog.records] == [
        "refused 1 request (overloaded) with 503: the queue ahead was predicted to outlast their timeout; "
        "tenants: refuse-late"
    ]


def test_a_request_is_judged_against_its_own_timeout() -> None:
    """A server timeout of 2000 s admits a 1000 s wait; a request's own 5 s does not."""
    state = overloaded_state(timeout_s=2000)
    state.refuse_late("m")
    with pytest.raises(ServiceUnavailable, match="past the 5s timeout") as refused:
        state.refuse_late("m", "", 5.0)
    assert refused.value.code == "overloaded"
    state.refuse_late("m", "", 1999.5)  # its own, longer than the wait: admitted
