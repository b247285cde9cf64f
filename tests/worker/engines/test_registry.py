"""The engine registry: names the CLIs offer, a clear error for an unknown one, capability flags
where the code used to test an engine's name, and no paddle import for the registry or the sim."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.cli import up, worker_cmd
from splitbus.env import load_env
from splitbus.tokenization import ModelTokenizer
from splitbus.worker import engines
from splitbus.worker.config import WorkerConfig
from splitbus.worker.engines import Capabilities, EngineSetup, EngineType, register
from splitbus.worker.engines.paddle import PaddleType
from splitbus.worker.engines.sim import SimConfig, SimEngine, SimType


def _choices(module: ModuleType, command: str) -> tuple[str, ...]:
    parser = argparse.ArgumentParser()
    module.add_parser(parser.add_subparsers(), load_env({}))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return tuple(next(a for a in sub._actions if a.dest == "engine").choices)


def test_the_clis_offer_the_registered_engines_their_default_first() -> None:
    assert {"sim", "paddle"} <= set(engines.names())
    assert _choices(worker_cmd, "worker") == engines.names(first="sim")
    assert _choices(up, "up") == engines.names(first="paddle")
    others = sorted(set(engines.names()) - {"sim", "paddle"})  # engines that tests registered
    assert engines.names(first="sim") == ("sim", *sorted(["paddle", *others]))
    assert engines.names(first="paddle") == ("paddle", *sorted(["sim", *others]))


def test_an_unknown_engine_is_a_clear_error(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match=r"engine must be one of \(.*'paddle'.*'sim'.*\), got 'nope'"):
        engines.get("nope")
    with pytest.raises(ValueError, match="got 'nope'"):
        engines.create("nope", EngineSetup(tiny_model, ModelTokenizer.load(tiny_model)))
    with pytest.raises(ValueError, match="got 'nope'"):
        WorkerConfig(bus=BusConfig(), role="mixed", model_dir=tiny_model, model_name="tiny", engine="nope")


def test_a_second_engine_under_a_taken_name_is_refused() -> None:
    class AnotherSim(EngineType):
        name = "sim"
        capabilities = Capabilities()
        kv_blocks_default = "1"

        def create(self, setup: EngineSetup) -> SimEngine:
            raise AssertionError("never created")

    with pytest.raises(ValueError, match="engine 'sim' is registered twice: SimType and .*AnotherSim"):
        register(AnotherSim)
    assert type(engines.get("sim")) is SimType
    assert register(SimType) is SimType  # the same class again (a module imported twice) is no conflict


def test_capability_flags_say_what_used_to_be_tested_by_name() -> None:
    assert engines.get("sim").capabilities == Capabilities(simulated_group=True)
    assert engines.get("paddle").capabilities == Capabilities(
        real_weights=True, needs_paddle=True, expert_parallel=True
    )
    assert isinstance(engines.get("paddle"), PaddleType)


def test_up_makes_a_weightless_model_for_an_engine_that_runs_no_weights(tmp_path: Path) -> None:
    folder = up.default_model(tmp_path, "sim")
    assert (folder / "tokenizer.json").exists() and json.loads((folder / "config.json").read_text())["vocab_size"]
    assert not (folder / "model.safetensors").exists()


def test_the_sim_is_built_from_its_options_and_its_own_kv_default(tiny_model: Path) -> None:
    tokenizer = ModelTokenizer.load(tiny_model)
    default = engines.create("sim", EngineSetup(tiny_model, tokenizer))
    assert isinstance(default, SimEngine) and default.total_blocks == 8192 and default.config == SimConfig()
    costs = SimConfig(decode_step_s=0.02)
    given = engines.create("sim", EngineSetup(tiny_model, tokenizer, block_size=32, kv_blocks=100, options=costs))
    assert isinstance(given, SimEngine) and (given.total_blocks, given.block_size, given.config) == (100, 32, costs)
    with pytest.raises(TypeError, match="the sim engine takes a SimConfig"):
        engines.create("sim", EngineSetup(tiny_model, tokenizer, options="fast"))
    with pytest.raises(ValueError, match="capacities must be >= 1"):
        EngineSetup(tiny_model, tokenizer, kv_blocks=0)


def test_the_sim_options_come_from_the_same_flags_as_before(tiny_model: Path) -> None:
    parser = argparse.ArgumentParser()
    worker_cmd.add_parser(parser.add_subparsers(), load_env({}))
    argv = ["worker", "--role", "mixed", "--model", str(tiny_model), "--sim-decode-step-ms", "20"]
    args = parser.parse_args([*argv, "--sim-kv-bytes-per-token", "8", "--sim-crash-token", "7", "--kv-blocks", "512"])
    engine = worker_cmd.build_engine(worker_cmd.build_config(args, load_env({})), ModelTokenizer.load(tiny_model), args)
    assert isinstance(engine, SimEngine) and engine.total_blocks == 512
    assert engine.config == SimConfig(decode_step_s=0.02, kv_bytes_per_token=8, crash_token=7)


def test_the_registry_and_the_sim_engine_import_no_paddle(tiny_model: Path) -> None:
    code = (
        "import sys\n"
        "from splitbus.cli.main import build_parser\n"
        "from splitbus.env import load_env\n"
        "from splitbus.tokenization import ModelTokenizer\n"
        "from splitbus.worker import engines\n"
        "build_parser(load_env({}))\n"
        f"engines.create('sim', engines.EngineSetup({str(tiny_model)!r}, ModelTokenizer.load({str(tiny_model)!r})))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('paddle', 'numpy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
