"""``splitbus bench engine``'s figures beyond the defaults (issue 41): decode at temperature 1 against
greedy, a long prompt's time and peak memory from a child process, and the same weights timed in
transformers (``--vs-transformers``, run for real where torch and transformers are installed). The
CLI runs on the tiny random model; the checks are on the shape and consistency of the output, never
on timings."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitbus.bench import engine_hf, report
from splitbus.gpu_ops import device

device.prepare()  # before paddle is imported by the tests that build a model here

HAVE_TRANSFORMERS = all(importlib.util.find_spec(name) for name in ("torch", "transformers"))
NO_TRANSFORMERS = "torch and transformers are not installed (pip install 'splitbus[bench-hf]')"


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", "bench", "engine", "--models", "tiny", "--runs", "1", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_sampled_decode_and_a_long_prompt_are_measured_and_shown(tmp_path: Path) -> None:
    proc = _bench("--long-prompt", "256", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = json.loads((tmp_path / "bench_engine.json").read_text())
    assert written["long_prompt"] == 256 and written["vs_transformers"] is False
    (tiny,) = written["results"]
    greedy, sampled = tiny["decode_b32_greedy_step_ms"], tiny["decode_b32_sampled_t1_step_ms"]
    assert greedy > 0 and sampled > 0
    assert tiny["decode_b32_sampled_t1_cost_pct"] == pytest.approx((sampled / greedy - 1) * 100, abs=0.2)
    assert tiny["long_prompt_tokens"] == 256 and tiny["long_prompt_ms"] > 0
    assert tiny["long_prompt_tok_s"] == pytest.approx(256 / tiny["long_prompt_ms"] * 1000, rel=0.01)
    assert tiny["long_prompt_peak_mib"] is not None and tiny["long_prompt_peak_mib"] >= 0
    assert tiny["long_prompt_rss_after_load_mib"] > 100  # paddle alone is ~300 MB resident
    assert tiny["long_prompt_score_matrix_mib"] == 4 * 256 * 256 * 4 / 2**20  # tiny: 4 heads
    assert "hf_prefill_tok_s" not in tiny
    assert "temperature 1" in proc.stdout and "a 256-token prompt" in proc.stdout
    assert (tmp_path / "bench_engine.png").read_bytes()[:4] == b"\x89PNG"


def test_long_prompt_zero_skips_it_and_a_negative_one_is_refused(tmp_path: Path) -> None:
    assert "must be 0 (skip)" in _bench("--long-prompt", "-1", "--out", str(tmp_path)).stdout
    proc = _bench("--long-prompt", "0", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tiny,) = json.loads((tmp_path / "bench_engine.json").read_text())["results"]
    assert "long_prompt_ms" not in tiny and "decode_b32_sampled_t1_step_ms" in tiny


def test_require_names_the_extra_when_torch_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torch" else object())
    with pytest.raises(engine_hf.MissingTransformers, match=r"needs torch: pip install 'splitbus\[bench-hf\]'"):
        engine_hf.require()


@pytest.mark.skipif(HAVE_TRANSFORMERS, reason="transformers is installed: the comparison runs instead")
def test_vs_transformers_without_it_exits_naming_the_extra(tmp_path: Path) -> None:
    proc = _bench("--long-prompt", "0", "--vs-transformers", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "pip install 'splitbus[bench-hf]'" in proc.stdout
    assert not (tmp_path / "bench_engine.json").exists()


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=NO_TRANSFORMERS)
def test_vs_transformers_times_both_sides_and_their_ratio(tmp_path: Path) -> None:
    proc = _bench("--long-prompt", "0", "--vs-transformers", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tiny,) = json.loads((tmp_path / "bench_engine.json").read_text())["results"]
    for key in report.ENGINE_VS_HF:
        assert tiny[f"hf_{key}_tok_s"] > 0
        assert tiny[f"vs_hf_{key}_x"] == pytest.approx(tiny[f"{key}_tok_s"] / tiny[f"hf_{key}_tok_s"], abs=0.01)
    assert "transformers" in proc.stdout and "paddle / hf" in proc.stdout


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=NO_TRANSFORMERS)
def test_the_saved_random_folder_gives_transformers_the_paddle_models_weights(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from splitbus.bench import engine
    from splitbus.worker.engines.paddle.model import Chunk

    built = engine._random_built(engine.MODELS["tiny"], tmp_path / "tiny")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ours = built.model.forward([Chunk(prompt, 0)])[0]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float32, use_kernels=False)
    with torch.inference_mode():
        theirs = hf(input_ids=torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4 * float(np.abs(theirs).max()))


def test_the_saved_random_folder_loads_as_the_model_in_memory(tmp_path: Path) -> None:
    from splitbus.bench import engine
    from splitbus.worker.engines.paddle.model import Chunk, load_model

    built = engine._random_built(engine.MODELS["tiny"], tmp_path / "tiny")
    assert built.folder == tmp_path / "tiny"
    chunk = [Chunk([5, 8, 13, 21], 0)]
    np.testing.assert_array_equal(built.model.forward(chunk), load_model(built.folder).forward(chunk))


def _result(**extra: Any) -> dict[str, Any]:
    base = {"model": "m", "params_m": 1.0, "kv_export_gb_s": 1.0, "kv_import_gb_s": 1.0}
    figures = {f"{k}_tok_s": 100.0 for k in report.ENGINE_VS_HF}
    return base | figures | extra


def test_the_table_compares_the_sides_only_for_models_measured_on_both() -> None:
    hf = {f"hf_{k}_tok_s": 50.0 for k in report.ENGINE_VS_HF} | {f"vs_hf_{k}_x": 2.0 for k in report.ENGINE_VS_HF}
    table = report.engine_table(
        {"device": "cpu", "threads": 1, "results": [_result(**hf), _result(model="other", kv_export_gb_s=2.0)]}
    )
    lines = table.splitlines()
    (ratio,) = [line for line in lines if "paddle / hf" in line]
    assert ratio.split()[-4:] == ["2.0x"] * 4
    assert [line.split()[0] for line in lines if line.strip().endswith("50.0")] == ["transformers"]


def test_the_table_says_when_the_peak_could_not_be_read() -> None:
    long = {
        "long_prompt_tokens": 4096,
        "long_prompt_ms": 9000.0,
        "long_prompt_tok_s": 455.1,
        "long_prompt_peak_mib": None,
        "long_prompt_rss_after_load_mib": 800.0,
        "long_prompt_score_matrix_mib": 576.0,
    }
    table = report.engine_table({"device": "cpu", "threads": 1, "results": [_result(**long)]})
    assert "a 4,096-token prompt: 9,000.0 ms (455.1 tok/s), peak RSS not measured" in table
    assert "576.0 MiB" in table
