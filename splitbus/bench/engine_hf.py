"""``splitbus bench engine --vs-transformers``: the same weights in Hugging Face transformers (torch on
the CPU, one thread), timed as ``bench engine`` times the paddle engine: one 128-token prompt's
prefill at batch 1, and a decode step at batch 1, 8 and 32 with a KV cache (a ``DynamicCache``, the
greedy token of each sequence chosen after the step), sequences 16 tokens in.

torch and transformers are not among splitbus' dependencies (torch's CPU wheel alone is ~190 MB):
they come with the ``bench-hf`` extra, and ``require`` says so when they are missing.
"""

from __future__ import annotations

import importlib.util
import json
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

INSTALL_HINT = "pip install 'splitbus[bench-hf]'"


class MissingTransformers(RuntimeError):
    """torch or transformers is not installed: ``--vs-transformers`` cannot run."""


def require() -> None:
    """Raise ``MissingTransformers`` naming the extra when torch or transformers cannot be imported;
    checked before any model is built, so a run fails in a second rather than after the paddle side."""
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingTransformers(f"--vs-transformers needs {' and '.join(missing)}: {INSTALL_HINT}")


def save_folder(raw: Mapping[str, Any], tensors: Mapping[str, np.ndarray], folder: Path, model_type: str) -> Path:
    """Write a random model as a Hugging Face folder (``config.json`` + ``model.safetensors``, fp32),
    so that the paddle engine and transformers load the same weights from it."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, "torch_dtype": "float32", **raw}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(dict(tensors), str(folder / "model.safetensors"))
    return folder


def bench_transformers(
    folder: Path, runs: int, batches: Sequence[int], progress: Callable[[str], None]
) -> dict[str, float]:
    """transformers' prefill and decode figures of the model in ``folder``, keyed ``hf_*`` as the
    paddle figures are keyed without the prefix."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # the paddle side's one thread
    # use_kernels=False: no kernels fetched from the Hub; transformers' own torch layers, as shipped.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_kernels=False).eval()
    result: dict[str, float] = {}
    # newer transformers warn that past_key_values is renamed; older ones know only that name
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        progress(f"transformers {folder.name}: prefill")
        prompt = torch.arange(1, 129).unsqueeze(0)
        prefill_s = best_of(runs, lambda: model(input_ids=prompt, use_cache=False))
        result["hf_prefill_tok_s"] = round(128 / prefill_s, 1)
        result["hf_prefill_ms"] = round(prefill_s * 1000, 1)
        for batch in batches:
            progress(f"transformers {folder.name}: decode at batch {batch}")
            step_s = _decode_step(model, batch, runs)
            result[f"hf_decode_b{batch}_tok_s"] = round(batch / step_s, 1)
            result[f"hf_decode_b{batch}_step_ms"] = round(step_s * 1000, 2)
    return result


def _decode_step(model: Any, batch: int, runs: int) -> float:
    """Seconds of the fastest decode step of ``batch`` sequences 16 tokens in, each step's greedy
    token fed to the next (a ``DynamicCache`` that grows as the paddle engine's paged cache does)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=torch.arange(1, 17).repeat(batch, 1), past_key_values=cache, use_cache=True)
    state = {"next": out.logits[:, -1].argmax(-1, keepdim=True)}

    def step() -> None:
        logits = model(input_ids=state["next"], past_key_values=cache, use_cache=True).logits
        state["next"] = logits[:, -1].argmax(-1, keepdim=True)

    return best_of(min(runs, 5), step)


def best_of(runs: int, work: Callable[[], Any]) -> float:
    """Seconds of the fastest of ``runs`` timed calls, after one warm-up (both sides time with it)."""
    work()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def ratios(result: Mapping[str, Any], batches: Sequence[int]) -> dict[str, float]:
    """paddle's tokens/s over transformers' for each figure both sides measured (> 1: paddle faster)."""
    keys = ["prefill_tok_s", *(f"decode_b{b}_tok_s" for b in batches)]
    return {
        f"vs_hf_{key.removesuffix('_tok_s')}_x": round(result[key] / result[f"hf_{key}"], 2)
        for key in keys
        if result.get(f"hf_{key}")
    }
