"""``splitbus bench engine --long-prompt N``: one N-token prompt prefilled at batch 1 into a paged
cache, its time and the memory the prefill itself takes.

The prefill runs in a child process of its own that loads the model from its folder: there, the
peak resident memory is reset after the model is loaded (``/proc/self/clear_refs``), so the peak
read after the forward is the prefill's alone, not the load's, and no buffer freed by an earlier
figure of the parent (glibc keeps them, ``gpu_ops/device.py``) hides what the prefill allocates.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from pathlib import Path
from typing import Any

BLOCK = 16
"""The paged cache's block size, as the engine's."""
MIB = 1 << 20


def measure(folder: Path, tokens: int) -> dict[str, Any]:
    """The long-prompt figures of the model in ``folder``, from a child process (spawned: the
    parent's paddle and its threads are not forked)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(prefill_in_child, str(folder), tokens).result()


def prefill_in_child(folder: str, tokens: int) -> dict[str, Any]:
    """Load the model, warm the forward up on a short prompt, then time one ``tokens``-token prompt
    into a paged cache and read the peak RSS it reached above the RSS before it."""
    from splitbus.gpu_ops import device

    device.prepare(1)
    device.select_device(1)
    from splitbus.worker.engines.paddle.model import Chunk, load_model

    model = load_model(Path(folder))
    vocab = model.config.vocab_size
    cache = model.new_cache(-(-tokens // BLOCK) + 2, BLOCK)
    table = cache.allocator.allocate(-(-tokens // BLOCK))
    model.forward([Chunk(list(range(1, 17)), 0, table)], cache)
    before = _status_kib("VmRSS")
    reset = _reset_peak()
    start = time.perf_counter()
    model.forward([Chunk([1 + i % (vocab - 2) for i in range(tokens)], 0, table)], cache)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    scores = model.config.heads * tokens * tokens * 4  # one layer's fp32 [heads, T, T] scores
    return {
        "long_prompt_tokens": tokens,
        "long_prompt_ms": round(seconds * 1000, 1),
        "long_prompt_tok_s": round(tokens / seconds, 1),
        "long_prompt_peak_mib": round((peak - before) / 1024, 1) if reset else None,
        "long_prompt_rss_after_load_mib": round(before / 1024, 1),
        "long_prompt_score_matrix_mib": round(scores / MIB, 1),
    }


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its RSS now; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB (VmRSS: resident now; VmHWM: the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)
