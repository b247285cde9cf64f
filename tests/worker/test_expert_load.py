"""A MoE worker's expert load as the worker reports it: in its core's load (which heartbeats, load
reports and DP steps write), in ``get_payload`` and in its Prometheus metrics; nothing of it for
an engine without experts. The engine is the sim engine, given an expert load to report (the
paddle engine's own counts are tested in tests/worker/engines/paddle/test_expert_load.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, generate_latest

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import WORKER_GROUP, Keys
from splitbus.bus.records import ExpertLoad, WorkerLoad
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.control import get_payload
from splitbus.worker.core import Limits, WorkerCore
from splitbus.worker.engines.interface import ExpertParallel
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.metrics import LoadCollector
from splitbus.worker.table import RequestTable

RANK_1_OF_2 = ExpertLoad(6, (3, 6), (4, 0, 2), (40, 7, 1000), weight_bytes=(5_000_000, 1_200_000))


class MoeSimEngine(SimEngine):
    """The sim engine with the expert placement and loads of rank 1 of 2 over a 6-expert model."""

    loads: ExpertLoad | None = RANK_1_OF_2

    async def form_expert_group(self, host: str, port: int, rank: int, size: int, timeout_s: float) -> None:
        raise AssertionError("not formed here")

    def expert_load(self) -> ExpertLoad | None:
        return self.loads


def _core(tiny_model: Path, engine_class: type[SimEngine] = MoeSimEngine) -> WorkerCore:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    engine = engine_class(SimConfig(), tokenizer, 16, 16)
    return WorkerCore(Limits("w1", "tiny"), engine, tokenizer)


def test_the_core_reports_the_engines_expert_load_and_none_without_one(tiny_model: Path) -> None:
    moe = _core(tiny_model)
    assert isinstance(moe.engine, ExpertParallel) and moe.load().experts == RANK_1_OF_2
    assert moe.load().total_kv_blocks == 16
    assert _core(tiny_model, SimEngine).load().experts is None  # the sim engine has no experts


@dataclass
class _Config:
    bus: BusConfig
    role: str = "decode"
    model_name: str = "tiny"
    engine: str = "paddle"
    block_size: int = 16
    max_requests: int = 8
    max_prefill_tokens: int = 512
    dp_group: str = "d0"
    dp_rank: int = 1
    dp_size: int = 2


@dataclass
class _Worker:
    """What ``get_payload`` reads of a worker (``ControlledWorker``)."""

    core: WorkerCore
    config: _Config
    redis: aioredis.Redis
    tokenizer: ModelTokenizer
    id: str = "w1"
    endpoint: str = "127.0.0.1:9"
    requests: RequestTable = field(default_factory=RequestTable)
    registry: None = None
    links: None = None

    @property
    def keys(self) -> Keys:
        return self.config.bus.keys

    def load(self) -> WorkerLoad:
        return self.core.load()


@pytest.mark.parametrize("experts", [RANK_1_OF_2, None])
async def test_get_payload_carries_the_expert_load(
    redis: aioredis.Redis, bus_config: BusConfig, tiny_model: Path, experts: ExpertLoad | None
) -> None:
    core = _core(tiny_model)
    assert isinstance(core.engine, MoeSimEngine)
    core.engine.loads = experts
    await redis.xgroup_create(bus_config.keys.tasks("w1"), WORKER_GROUP, id="0", mkstream=True)
    payload = await get_payload(_Worker(core, _Config(bus_config), redis, core.tokenizer))  # type: ignore[arg-type]
    assert payload["dp_rank"] == 1 and payload["total_kv_blocks"] == 16
    if experts is None:
        assert payload["experts"] is None
        return
    assert payload["experts"] == {
        "experts_per_layer": 6,
        "held": [3, 6],
        "last_forward_tokens": [4, 0, 2],
        "total_tokens": [40, 7, 1000],
        "weight_bytes": {"dense": 5_000_000, "experts": 1_200_000},
    }


def _scrape(*loads: WorkerLoad) -> str:
    collector, registry = LoadCollector(), CollectorRegistry()
    collector.loads.extend(lambda load=load: load for load in loads)
    registry.register(collector)
    return generate_latest(registry).decode()


def test_the_metrics_count_tokens_per_held_expert() -> None:
    text = _scrape(WorkerLoad(experts=RANK_1_OF_2))
    assert "splitbus_worker_experts 6.0" in text
    for expert, tokens in ((3, 40), (4, 7), (5, 1000)):
        assert f'splitbus_worker_expert_held{{expert="{expert}"}} 1.0' in text
        assert f'splitbus_worker_expert_tokens_total{{expert="{expert}"}} {tokens:.1f}' in text
    assert 'expert="2"' not in text  # not held here
    assert 'splitbus_worker_weight_bytes{part="dense"} 5e+06' in text
    assert 'splitbus_worker_weight_bytes{part="experts"} 1.2e+06' in text


def test_two_workers_of_one_process_add_up_by_expert_and_a_dense_one_shows_none() -> None:
    rank_0 = ExpertLoad(6, (0, 4), (0,) * 4, (1, 2, 3, 4), weight_bytes=(5_000_000, 1_600_000))
    text = _scrape(WorkerLoad(experts=RANK_1_OF_2), WorkerLoad(experts=RANK_1_OF_2), WorkerLoad(experts=rank_0))
    assert 'splitbus_worker_expert_held{expert="3"} 3.0' in text
    assert 'splitbus_worker_expert_tokens_total{expert="3"} 84.0' in text  # 40 + 40 + 4
    assert 'splitbus_worker_expert_tokens_total{expert="0"} 1.0' in text
    dense = _scrape(WorkerLoad(running=2))
    assert "splitbus_worker_experts 0.0" in dense and "expert=" not in dense and "part=" not in dense
