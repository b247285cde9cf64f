"""``splitbus worker --device``, ``--kv-cache-mb`` and ``--gpu-memory-fraction``
(splitbus/cli/worker_cmd.py): what reaches the engine's setup, a bad value as a usage error, and
a GPU Paddle does not see as a clear error at start (this machine has none)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from splitbus.cli import worker_cmd
from splitbus.cli.main import build_parser
from splitbus.env import load_env
from splitbus.worker import engines
from splitbus.worker.engines import EngineSetup
from splitbus.worker.engines.paddle.tiny import make_tiny_model


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser(load_env({})).parse_args(["worker", "--role", "mixed", *argv])


def _setup(monkeypatch: pytest.MonkeyPatch, *argv: str) -> EngineSetup:
    """The setup ``build_engine`` gives the sim engine for these arguments."""
    made: list[EngineSetup] = []
    monkeypatch.setattr(type(engines.get("sim")), "create", lambda self, setup: made.append(setup))
    args = _parse("--model", "m", *argv)
    worker_cmd.build_engine(_Config(), None, args)  # type: ignore[arg-type]  # what build_engine reads
    return made[0]


class _Config:
    engine, model_dir, block_size, dp_rank, dp_size, ep = "sim", Path("m"), 16, -1, 0, False


def test_the_device_and_the_kv_budget_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    default = _setup(monkeypatch)
    assert (default.device, default.kv_cache_bytes, default.gpu_memory_fraction) == ("auto", None, 0.9)
    given = _setup(monkeypatch, "--device", "gpu:1", "--kv-cache-mb", "64", "--gpu-memory-fraction", "0.45")
    assert (given.device, given.kv_cache_bytes, given.gpu_memory_fraction) == ("gpu:1", 64 * 2**20, 0.45)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "half", "nan"])
def test_a_gpu_memory_fraction_outside_0_to_1_is_a_usage_error(capsys: pytest.CaptureFixture[str], value: str) -> None:
    with pytest.raises(SystemExit) as stopped:
        _parse("--model", "m", "--gpu-memory-fraction", value)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --gpu-memory-fraction: a fraction of the GPU's memory in (0, 1], got '{value}'" in err


@pytest.mark.parametrize("value", ["gpu", "cuda:0", "gpu:x", "GPU:1"])
def test_a_bad_device_is_a_usage_error(capsys: pytest.CaptureFixture[str], value: str) -> None:
    with pytest.raises(SystemExit) as stopped:
        _parse("--model", "m", "--device", value)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --device: device must be auto, cpu or gpu:N (N a GPU's index), got '{value}'" in err
    assert "Traceback" not in err


def test_a_gpu_paddle_does_not_see_stops_the_worker_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "tiny", "llama", seed=1)
    args = _parse("--engine", "paddle", "--model", str(model), "--device", "gpu:3", "--data-dir", str(tmp_path))
    assert worker_cmd.run(args, load_env({})) == 2
    assert "splitbus worker: --device gpu:3: Paddle sees 0 GPU(s) here (a CPU build?)" in capsys.readouterr().out


def test_the_kernels_choice_reaches_the_paddle_engine_and_a_bad_one_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from splitbus.worker.engines.paddle import PaddleOptions

    paddle_type = engines.get("paddle")
    assert paddle_type.options_from(_parse("--model", "m")) == PaddleOptions("auto")
    assert paddle_type.options_from(_parse("--model", "m", "--paddle-kernels", "paddle")) == PaddleOptions("paddle")
    with pytest.raises(SystemExit) as stopped:
        _parse("--model", "m", "--paddle-kernels", "turbo")
    assert stopped.value.code == 2 and "argument --paddle-kernels: invalid choice: 'turbo'" in capsys.readouterr().err
