"""Early refusal as an API process applies it (``ApiState.refuse_late``), with no Redis: a state
whose registry view holds a prefill worker with a deep queue and whose prefill rate is measured,
so that the prediction passes the deadline."""

from __future__ import annotations

import logging

import pytest

from splitbus.api import metrics
from splitbus.api.config import ApiConfig
from splitbus.api.errors import ApiError, ServiceUnavailable
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


def _mix(state: ApiState, priorities: dict[int, int]) -> None:
    """The node's requests not started yet: ``priorities[p]`` of priority p."""
    for priority, count in priorities.items():
        for i in range(count):
            state.waiting.add(f"r{priority}-{i}", priority)


def test_under_overload_the_lowest_priority_is_refused_first() -> None:
    """1000 requests ahead at 1/s; the node's own not-started requests are 95 % priority 0 and 5 %
    priority -1: a priority -1 request waits behind about 50 (50 s), a priority 0 one behind all."""
    state = overloaded_state(timeout_s=100)
    _mix(state, {0: 95, -1: 5})
    state.workers.redis_ok = True  # as after the view's first read: admit's other guards pass
    state.refuse_late("m", "", 100.0, priority=-1)
    state.admit("m", "", 100.0, priority=-1)  # the whole admission too: it takes its slot
    assert state.inflight == 1
    with pytest.raises(ServiceUnavailable, match="predicted to take 1000s") as refused:
        state.admit("m", "", 100.0, priority=0)
    assert refused.value.code == "overloaded" and state.inflight == 1
    with pytest.raises(ServiceUnavailable, match="predicted to take 1000s"):
        state.refuse_late("m", "", 100.0, priority=5)  # later than all the node tracks: behind all


def test_the_priority_share_is_judged_against_the_deadline() -> None:
    """At priority -1 the predicted wait is 50 s: admitted with 60 s, refused with 40 s."""
    state = overloaded_state(timeout_s=100)
    _mix(state, {0: 95, -1: 5})
    state.refuse_late("m", "", 60.0, priority=-1)
    with pytest.raises(ServiceUnavailable, match="predicted to take 50s, past the 40s timeout"):
        state.refuse_late("m", "", 40.0, priority=-1)


def test_the_unread_stream_counts_whole_whatever_the_priority() -> None:
    """The request stream's unread entries are read in arrival order: a request of an earlier
    priority waits behind all of them, and its share counts only the queues ordered by priority
    (held by a scheduler, waiting at the workers). 200 unread, 100 held, 1000 at the worker, the
    mix 95/5: at priority -1, 200 + 55 requests ahead (255 s)."""
    state = overloaded_state(timeout_s=300)
    _mix(state, {0: 95, -1: 5})
    state.unread, state.held = 200, 100
    state.refuse_late("m", "", 300.0, priority=-1)
    with pytest.raises(ServiceUnavailable, match="predicted to take 255s, past the 250s timeout"):
        state.refuse_late("m", "", 250.0, priority=-1)


def test_with_nothing_tracked_every_priority_waits_behind_the_whole_queue() -> None:
    """No request of the node's own waits: no mix to share by, the queue ahead counts whole."""
    state = overloaded_state(timeout_s=100)
    with pytest.raises(ServiceUnavailable, match="predicted to take 1000s"):
        state.refuse_late("m", "", 100.0, priority=-1)


def test_requests_leave_the_mix_when_they_start() -> None:
    """Once the node's priority 0 requests have started, only priority -1 ones wait: a new one of
    priority -1 is behind the whole queue again."""
    state = overloaded_state(timeout_s=100)
    _mix(state, {0: 95, -1: 5})
    state.refuse_late("m", "", 100.0, priority=-1)
    for i in range(95):
        state.started(f"r0-{i}")
        state.started(f"r0-{i}")  # its first result, then its close: once
    assert state.waiting.mix == {-1: 5}
    with pytest.raises(ServiceUnavailable, match="predicted to take 1000s"):
        state.refuse_late("m", "", 100.0, priority=-1)


@pytest.mark.parametrize(
    ("setup", "outcome", "status"),
    [
        ({"inflight": 10}, "inflight", 429),
        ({"backlog": 10}, "backlog", 429),
        ({"redis_ok": False}, "unavailable", 503),
        ({"workers": []}, "no_worker", 503),
    ],
)
def test_every_refusal_at_admission_counts_under_its_tenant(
    setup: dict[str, object], outcome: str, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API's own bounds and a fleet it cannot reach refuse a request before anything is
    published: each counts as its tenant's refusal, by reason, as the tenant limits' do."""
    monkeypatch.setattr(metrics, "REFUSALS", metrics.Refusals())
    state = overloaded_state(early_refusal=False, max_inflight=10, max_backlog=10)
    state.inflight, state.backlog = int(setup.get("inflight", 0)), int(setup.get("backlog", 0))  # type: ignore[call-overload]
    state.workers.redis_ok = "redis_ok" not in setup  # as a view that has read the registry
    if "workers" in setup:
        state.workers.workers = []
    counted = metrics.TENANT_REQUESTS.labels("admission-bounds", outcome)
    before = counted._value.get()
    with pytest.raises(ApiError) as refused:
        state.admit("m", "admission-bounds")
    assert refused.value.status == status and counted._value.get() == before + 1
    assert state.inflight == int(setup.get("inflight", 0))  # type: ignore[call-overload]  # no slot taken
