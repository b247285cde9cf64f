"""`splitbus make-tiny-model`, a worker given a bad model folder, and `splitbus bench engine`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SPLITBUS = [sys.executable, "-m", "splitbus.cli.main"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SPLITBUS, *args], capture_output=True, text=True, timeout=timeout)


def test_make_tiny_model_writes_a_hugging_face_folder(tmp_path: Path) -> None:
    out = _run("make-tiny-model", str(tmp_path / "q"), "--arch", "qwen2", "--dtype", "bfloat16")
    assert out.returncode == 0, out.stdout + out.stderr
    files = {p.name for p in (tmp_path / "q").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert "chat_template" in json.loads((tmp_path / "q" / "tokenizer_config.json").read_text())


def test_worker_with_a_bad_model_folder_exits_naming_the_problem(tmp_path: Path, redis_server: object) -> None:
    folder = tmp_path / "m"
    assert _run("make-tiny-model", str(folder)).returncode == 0
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 128
    (folder / "config.json").write_text(json.dumps(config))
    out = _run(
        "worker", "--role", "mixed", "--engine", "paddle", "--model", str(folder), "--redis-url", redis_server.url
    )  # type: ignore[attr-defined]
    assert out.returncode == 2
    assert "tensor model.embed_tokens.weight has shape [259, 256], expected [259, 128]" in out.stdout


def test_bench_engine_writes_json_and_png(tmp_path: Path) -> None:
    out = _run("bench", "engine", "--models", "tiny", "--runs", "1", "--long-prompt", "256", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "bench_engine.json").read_text())
    (tiny,) = report["results"]
    for key in (
        "prefill_tok_s",
        "decode_b1_tok_s",
        "decode_b8_tok_s",
        "decode_b32_tok_s",
        "kv_export_gb_s",
        "kv_import_gb_s",
        "long_prompt_tok_s",
    ):
        assert tiny[key] > 0
    assert (tmp_path / "bench_engine.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_engine_measures_a_given_model_folder(tmp_path: Path) -> None:
    assert _run("make-tiny-model", str(tmp_path / "my-model"), "--hidden", "64", "--layers", "2").returncode == 0
    model, o = str(tmp_path / "my-model"), str(tmp_path / "o")
    argv = ("--runs", "1", "--out", o, "--prefill-batches", "1", "8", "--long-prompt", "0")
    out = _run("bench", "engine", "--model", model, *argv)
    assert out.returncode == 0, out.stdout + out.stderr
    (result,) = json.loads((tmp_path / "o" / "bench_engine.json").read_text())["results"]  # not the random ones
    assert result["model"] == "my-model" and result["decode_b32_tok_s"] > 0
    assert result["prefill_tok_s"] > 0 and result["prefill_b8_tok_s"] > 0 and "prefill_b32_tok_s" not in result
    assert "prefill_b8_tok_s" in out.stdout  # the table has the column


def test_bench_engine_refuses_a_prefill_batch_over_the_engines_bound(tmp_path: Path) -> None:
    out = _run("bench", "engine", "--models", "tiny", "--prefill-batches", "33", "--out", str(tmp_path))
    assert out.returncode == 2 and "--prefill-batches must be between 1 and 32" in out.stdout
