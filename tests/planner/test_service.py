"""The planner's shell against a real Redis (splitbus/planner/service.py): workers registered
and beating as real ones do -> the advice in ``sb:planner:{cell}``, the gauges, and one log line
only when an advised count changes; a Redis error skips the interval."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError

from splitbus.bus.core.config import BusConfig
from splitbus.bus.planner import Reason, read_advice
from splitbus.bus.records import WorkerLoad
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.cli.main import build_parser
from splitbus.env import Env
from splitbus.planner import metrics
from splitbus.planner.config import PlannerConfig
from splitbus.planner.core import Decision, Reading
from splitbus.planner.predictors import PREDICTORS
from splitbus.planner.service import PlannerService

LEASE_MS = 10_000
CONFIG = PlannerConfig(ttft_slo_s=0.5, itl_slo_s=0.02, max_workers=3, model="m")
KV = {"total_kv_blocks": 1000, "free_kv_blocks": 900, "running": 10}
"""A decode worker whose running requests hold 10 blocks each: 90 fit at 90 %."""


def _gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def _fleet(registry: Registry) -> None:
    for worker_id, role, model in (("p1", "prefill", "m"), ("d1", "decode", "m"), ("other", "prefill", "n")):
        await registry.register(WorkerRecord(worker_id, role, model), LEASE_MS)
    await registry.heartbeat("d1", WorkerLoad(**KV), LEASE_MS)


async def _busy(registry: Registry) -> None:
    """A second's worth of work: 100 prompts of 1000 tokens, 100 outputs of 200 tokens."""
    prefill = WorkerLoad(prefills_done=100, prompt_tokens_done=100_000, prefill_busy_us=5_000_000, waiting=2)
    decode = WorkerLoad(decodes_done=100, decode_tokens_done=19_900, decode_steps=1990, decode_time_us=19_900_000, **KV)
    await registry.heartbeat("p1", prefill, LEASE_MS)
    await registry.heartbeat("d1", decode, LEASE_MS)


@pytest.fixture
async def fleet(redis: aioredis.Redis, bus_config: BusConfig) -> Registry:
    """Two workers of model m and one of n, registered as real workers register."""
    registry = Registry(redis, bus_config)
    await _fleet(registry)
    return registry


async def _two_intervals(service: PlannerService, fleet: Registry) -> Decision:
    """A first interval that measures, then one over which work was done."""
    await service.tick()
    await _busy(fleet)
    await asyncio.sleep(0.01)  # the next reading a few ms later on the server's clock
    decision = await service.tick()
    assert decision is not None
    return decision


async def test_the_first_interval_measures_and_says_so_once(
    redis: aioredis.Redis,
    redis_admin: sync_redis.Redis,
    bus_config: BusConfig,
    fleet: Registry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = PlannerService(bus_config, CONFIG, redis)
    caplog.set_level(logging.INFO, "splitbus.planner.service")
    first = await service.tick()
    assert first is not None
    assert first.prefill.reason is Reason.MEASURING
    advice = read_advice(redis_admin, bus_config.keys)
    assert advice is not None
    assert (advice.desired_prefill, advice.actual_prefill, advice.desired_decode) == (1, 1, 1)  # "other" is model n
    assert [r.getMessage() for r in caplog.records] == [
        "planner: prefill 1 -> 1 (measuring); decode 1 -> 1 (measuring)"
    ]
    caplog.clear()
    await asyncio.sleep(0.01)
    assert (await service.tick()) is not None
    assert caplog.records == []  # nothing changed, nothing said


async def test_work_done_makes_the_advice_and_one_line(
    redis: aioredis.Redis,
    redis_admin: sync_redis.Redis,
    bus_config: BusConfig,
    fleet: Registry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = PlannerService(bus_config, CONFIG, redis)
    await service.tick()
    caplog.set_level(logging.INFO, "splitbus.planner.service")
    await _busy(fleet)
    await asyncio.sleep(0.01)
    decision = await service.tick()
    assert decision is not None
    # 100 prefills in a few ms is thousands of requests/s: every count at --max-workers
    assert (decision.prefill.desired, decision.prefill.reason) == (3, Reason.SLO)
    assert (decision.decode.desired, decision.decode.reason, decision.batch_at_slo) == (3, Reason.KV_BOUND, 90)
    advice = read_advice(redis_admin, bus_config.keys)
    assert advice is not None
    assert (advice.desired_prefill, advice.desired_decode, advice.reason_decode) == (3, 3, Reason.KV_BOUND)
    assert (advice.prompt_tokens, advice.prefill_tokens_per_s) == (pytest.approx(1000), pytest.approx(20_000))
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["planner: prefill 1 -> 3"]


async def test_the_gauges_show_the_decision(redis: aioredis.Redis, bus_config: BusConfig, fleet: Registry) -> None:
    service = PlannerService(bus_config, CONFIG, redis)
    ups = _gauge("splitbus_planner_decisions_total", role="prefill", direction="up") or 0
    decision = await _two_intervals(service, fleet)
    expected = {
        ("splitbus_planner_desired_workers", "decode"): 3,
        ("splitbus_planner_desired_groups", "prefill"): 3,
        ("splitbus_planner_actual_workers", "prefill"): 1,
        ("splitbus_planner_draining_workers", "decode"): 0,
        ("splitbus_planner_waiting_requests", "prefill"): 2,
        ("splitbus_planner_unplaced_requests", ""): 0,
        ("splitbus_planner_arrival_requests_per_second", ""): pytest.approx(decision.arrivals_rps),
        ("splitbus_planner_predicted_requests_per_second", ""): pytest.approx(decision.predicted_rps),
        ("splitbus_planner_prefix_hit_ratio", ""): 0,
        ("splitbus_planner_decisions_total", "prefill"): ups + 1,
    }
    shown = {(name, role): _gauge(name, **_labels(name, role)) for name, role in expected}
    assert shown == expected


def _labels(name: str, role: str) -> dict[str, str]:
    labels = {"role": role} if role else {}
    return labels | ({"direction": "up"} if name.endswith("_total") else {})


async def test_a_redis_error_skips_the_interval(
    redis: aioredis.Redis, bus_config: BusConfig, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = PlannerService(bus_config, CONFIG, redis)

    async def refused() -> None:
        raise RedisConnectionError("connection refused")

    monkeypatch.setattr(service._registry, "snapshot_at", refused)
    caplog.set_level(logging.WARNING, "splitbus.planner.service")
    assert await service.tick() is None
    assert "skipping an interval, reading Redis failed: connection refused" in caplog.text
    assert await redis.exists(bus_config.keys.planner) == 0


async def test_an_error_deciding_skips_the_interval_and_the_next_decides(
    redis: aioredis.Redis, bus_config: BusConfig, fleet: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    service = PlannerService(bus_config, CONFIG, redis)
    step = service._planner.step

    def broken(reading: Reading) -> Decision:
        raise ZeroDivisionError("division by zero")

    service._planner.step = broken  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, "splitbus.planner.service")
    assert await service.tick() is None
    assert "planner: skipping an interval, deciding failed" in caplog.text
    assert "ZeroDivisionError: division by zero" in caplog.text  # the traceback logged with it
    assert await redis.exists(bus_config.keys.planner) == 0
    service._planner.step = step  # type: ignore[method-assign]
    assert await service.tick() is not None
    assert await redis.exists(bus_config.keys.planner) == 1


async def test_an_error_showing_the_decision_keeps_the_advice(
    redis: aioredis.Redis,
    bus_config: BusConfig,
    fleet: Registry,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = PlannerService(bus_config, CONFIG, redis)

    def broken(*args: object) -> None:
        raise ValueError("a gauge refused")

    monkeypatch.setattr(metrics, "show", broken)
    caplog.set_level(logging.WARNING, "splitbus.planner.service")
    assert await service.tick() is not None
    assert "planner: could not show the decision" in caplog.text and "ValueError: a gauge refused" in caplog.text
    assert await redis.exists(bus_config.keys.planner) == 1  # published before the gauges


async def test_run_advises_until_asked_to_stop(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    service = PlannerService(bus_config, CONFIG, redis)
    running = asyncio.create_task(service.run())
    for _ in range(200):  # bounded: the first interval's advice
        if await redis.exists(bus_config.keys.planner):
            break
        await asyncio.sleep(0.05)
    service.stopping.set()
    await asyncio.wait_for(running, 10)  # within the 5 s interval's wait: it wakes on the event
    assert await redis.exists(bus_config.keys.planner) == 1


PLANNER = ["planner", "--ttft-slo-ms", "500", "--itl-slo-ms", "20"]


@pytest.mark.parametrize("name", sorted(PREDICTORS))
def test_every_predictor_is_a_cli_choice(name: str) -> None:
    assert build_parser(Env()).parse_args([*PLANNER, "--predictor", name]).predictor == name


def test_the_cli_defaults_and_refuses_an_unknown_predictor() -> None:
    args = build_parser(Env()).parse_args(PLANNER)
    assert (args.predictor, args.interval_s, args.cell, args.min_workers, args.max_workers) == (
        "last",
        5.0,
        "main",
        0,
        1000,
    )
    assert args.start_delay_s == PlannerConfig(0.5, 0.02).start_delay_s == 30.0
    with pytest.raises(SystemExit):
        build_parser(Env()).parse_args([*PLANNER, "--predictor", "arima"])


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--itl-slo-ms", "inf"),
        ("--ttft-slo-ms", "nan"),
        ("--itl-slo-ms", "0"),
        ("--interval-s", "-1"),
        ("--scale-down-window-s", "inf"),
        ("--start-delay-s", "-1"),
        ("--ttft-slo-ms", "1e400"),
    ],
)
def test_the_cli_refuses_a_number_not_finite_or_out_of_range(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser(Env()).parse_args([*PLANNER, flag, value])
    error = capsys.readouterr().err
    assert f"argument {flag}: must be a finite number" in error and "usage:" in error
