"""Adding an engine is one new file: this module is that file. It defines an engine, registers
it by name and nothing else; the registry creates it, the worker CLI offers it with its own
option, and a real Worker serves a request with it over a real Redis."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.streams import Producer
from splitbus.bus.messages import Finished, GenerateRequest, SamplingParams, Task, TokenDelta
from splitbus.bus.results import ResultReader, Subscription
from splitbus.cli import up, worker_cmd
from splitbus.env import load_env
from splitbus.tokenization import ModelTokenizer
from splitbus.worker import engines
from splitbus.worker.config import WorkerConfig
from splitbus.worker.engines import Capabilities, EngineSetup, EngineType, register
from splitbus.worker.sequence import Sequence
from splitbus.worker.worker import Worker


@dataclass(frozen=True)
class EchoOptions:
    delay_s: float = 0.0


class EchoEngine:
    """Generates its prompt again, token by token; holds no KV it could ship."""

    eos_token_ids: tuple[int, ...] = ()
    kv_events = None  # no prefix cache: no KV events

    def __init__(self, options: EchoOptions, vocab_size: int, total_blocks: int, block_size: int) -> None:
        self.options, self.vocab_size = options, vocab_size
        self.total_blocks, self.block_size, self.free_blocks = total_blocks, block_size, total_blocks

    def reserve(self, seq: Sequence, tokens: int) -> bool:
        needed = -(-tokens // self.block_size)
        if needed > self.free_blocks:
            return False
        self.free_blocks -= needed
        seq.blocks = needed
        return True

    def cached_prefix(self, task: Task) -> int:
        return 0  # no prefix cache

    def can_reserve(self, task: Task, tokens: int) -> bool:
        return self.free_blocks >= -(-tokens // self.block_size)

    def kv_capacity(self, seq: Sequence) -> int:
        return 0

    def release(self, seq: Sequence) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0

    def first_to_compute(self, seq: Sequence) -> int | None:
        return None  # no prefix cache: nothing to share

    async def prefill(self, batch: list[Sequence]) -> list[int]:
        return await self.decode(batch)

    async def decode(self, batch: list[Sequence]) -> list[int]:
        await asyncio.sleep(self.options.delay_s)
        return [s.request.prompt_token_ids[len(s.output_ids) % s.prompt_len] for s in batch]

    async def export_kv(self, seq: Sequence) -> bytes:
        raise NotImplementedError("the echo engine holds no KV")

    async def import_kv(self, seq: Sequence, payload: bytes) -> str | None:
        return "the echo engine holds no KV"

    async def idle(self) -> None:
        await asyncio.sleep(self.options.delay_s)


@register
class EchoType(EngineType):
    name = "echo"
    capabilities = Capabilities(kv_transfer=False)
    kv_blocks_default = "64"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--echo-delay-ms", type=float, default=0.0, help="sleep per step")

    def options_from(self, args: argparse.Namespace) -> EchoOptions:
        return EchoOptions(args.echo_delay_ms / 1e3)

    def create(self, setup: EngineSetup) -> EchoEngine:
        options = setup.options if isinstance(setup.options, EchoOptions) else EchoOptions()
        return EchoEngine(options, setup.tokenizer.vocab_size, setup.kv_blocks or 64, setup.block_size)


# ---------------------------------------------------------------- what registering it gives


def _worker_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_cmd.add_parser(parser.add_subparsers(), load_env({}))
    return parser.parse_args(["worker", *extra])


def test_the_registry_creates_it_by_name(tiny_model: Path) -> None:
    engine = engines.create("echo", EngineSetup(tiny_model, ModelTokenizer.load(tiny_model), kv_blocks=10))
    assert isinstance(engine, EchoEngine) and engine.total_blocks == 10
    assert "echo" in engines.names()


def test_the_worker_cli_offers_it_and_its_option(tiny_model: Path) -> None:
    args = _worker_args("--role", "mixed", "--engine", "echo", "--model", str(tiny_model), "--echo-delay-ms", "2")
    config = worker_cmd.build_config(args, load_env({}))
    engine = worker_cmd.build_engine(config, ModelTokenizer.load(tiny_model), args)
    assert isinstance(engine, EchoEngine) and engine.options == EchoOptions(0.002) and engine.total_blocks == 64


def test_its_flags_are_what_the_rest_checks(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="the echo engine cannot ship KV: it runs only as --role mixed"):
        WorkerConfig(bus=BusConfig(), role="prefill", model_dir=tiny_model, model_name="tiny", engine="echo")
    prepared: list[int] = []
    monkeypatch.setattr("splitbus.gpu_ops.device.prepare", prepared.append)  # records the CPU tuning, no paddle
    args = _worker_args("--role", "mixed", "--engine", "echo", "--model", str(tiny_model), "--threads", "3")
    config = worker_cmd.build_config(args, load_env({}))
    worker_cmd.build_engine(config, ModelTokenizer.load(tiny_model), args)
    assert prepared == []
    monkeypatch.setattr(EchoType, "capabilities", Capabilities(kv_transfer=False, needs_paddle=True))
    worker_cmd.build_engine(config, ModelTokenizer.load(tiny_model), args)
    assert prepared == [3]


def test_up_runs_it_only_where_it_can_and_makes_its_default_model(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers(), load_env({}))
    with pytest.raises(ValueError, match="the echo engine cannot ship KV from prefill to decode: run it as --mixed N"):
        up.worker_counts(parser.parse_args(["up", "--engine", "echo"]))  # 1 prefill + 1 decode by default
    assert up.worker_counts(parser.parse_args(["up", "--engine", "echo", "--mixed", "2"])) == (0, 0, 2)
    folder = up.default_model(tmp_path, "echo")  # the base type's: a tokenizer and config.json, no weights
    assert ModelTokenizer.load(folder).vocab_size > 0 and not (folder / "model.safetensors").exists()


async def _drain(sub: Subscription) -> list[object]:
    return [result async for result in sub]


async def test_a_worker_serves_a_request_with_it(bus_config: BusConfig, tiny_model: Path) -> None:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(
        bus=bus_config, role="mixed", model_dir=tiny_model, model_name="tiny", engine="echo", worker_id="e1"
    )
    worker = Worker(config, tokenizer, engines.create("echo", EngineSetup(tiny_model, tokenizer)))
    running = asyncio.create_task(worker.run())
    reader = ResultReader(bus_config, worker.redis, name="api-echo")
    await reader.start()
    prompt = tokenizer.encode("echo")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    request = GenerateRequest("r-echo", "tiny", prompt, params, "api", 0, reader=reader.reader_of("r-echo"))
    try:
        sub = await reader.subscribe("r-echo")
        await Producer(worker.redis, bus_config).send(bus_config.keys.tasks("e1"), Task("mixed", request))
        entries = await asyncio.wait_for(_drain(sub), 20)
    finally:
        await reader.close()
        worker.stopping.set()
        await asyncio.wait_for(running, 10)
    tokens = [t for e in entries if isinstance(e, TokenDelta) for t in e.token_ids]
    assert tokens == (prompt * 2)[:6]
    assert "".join(e.text for e in entries if isinstance(e, TokenDelta)) == "echoec"
    assert isinstance(entries[-1], Finished) and entries[-1].finish_reason == "length"
