"""Process set-up for Paddle: CPU settings that must precede ``import paddle``, and the device.

Measured on 2 vCPU: these settings make CPU inference ~4x faster. The device is named as the
worker's ``--device`` names it: ``auto``, ``cpu`` or ``gpu:N``. What reads a GPU (its count, compute
capability, free memory) is behind the functions here, and has never run on a GPU: this project's
machines have none, and its tests fake what Paddle would report.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
ONE_GIB = 1 << 30
BF16_MIN_CAPABILITY = 8
"""A GPU's compute capability (major) from which it computes in bfloat16 (Ampere, 8.0, and later)."""
_SPEC = re.compile(r"auto|cpu|gpu:(0|[1-9][0-9]*)")


def parse_device(text: str) -> str:
    """``--device``'s value as given, if it is ``auto``, ``cpu`` or ``gpu:N``; ValueError otherwise."""
    if not _SPEC.fullmatch(text):
        raise ValueError(f"device must be auto, cpu or gpu:N (N a GPU's index), got {text!r}")
    return text


def prepare(threads: int = 1) -> None:
    """Call before the first ``import paddle``."""
    os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")  # AMD CPUs: the bundled MKL's fast path
    os.environ.setdefault("FLAGS_use_stride_kernel", "0")  # contiguous transposes, no 4 ms copies later
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    warnings.filterwarnings("ignore", message=".*ccache.*")
    _keep_freed_memory()


def _keep_freed_memory() -> None:
    """glibc returns big buffers to the OS and page-faults on every reuse; both thresholds must
    be raised for it to keep them."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, ONE_GIB)
        libc.mallopt(M_TRIM_THRESHOLD, ONE_GIB)


def select_device(threads: int = 1, spec: str = "auto") -> str:
    """Make ``spec`` (``parse_device``'s) Paddle's device and return it as Paddle names it:
    ``auto`` is the first GPU when Paddle sees one, else the CPU (with ``threads`` math threads).
    ValueError when ``spec`` names a GPU that Paddle does not see."""
    import paddle

    gpus = paddle.device.cuda.device_count() if paddle.device.is_compiled_with_cuda() else 0
    if spec == "auto":
        spec = "gpu:0" if gpus else "cpu"
    if spec != "cpu":
        if int(spec.removeprefix("gpu:")) >= gpus:
            raise ValueError(f"--device {spec}: Paddle sees {gpus} GPU(s) here" + ("" if gpus else " (a CPU build?)"))
        paddle.set_device(spec)
        return spec
    paddle.set_device("cpu")
    try:
        paddle.base.core.set_num_threads(threads)  # 3.x
    except AttributeError:
        pass
    return "cpu"


def release_unused_memory() -> None:
    """Give back what loading weights left behind (measured: RSS 3.6 -> 2.2 GB for 0.5B)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def computes_bf16(where: str) -> bool:
    """Whether ``where`` (``select_device``'s answer) computes in bfloat16: a GPU of compute
    capability 8 or more. Never the CPU: Paddle's CPU build has no bfloat16 matmul kernel."""
    if where == "cpu":
        return False
    import paddle

    major, _ = paddle.device.cuda.get_device_capability(_index(where))
    return major >= BF16_MIN_CAPABILITY


def free_bytes(where: str) -> int | None:
    """Bytes free on the GPU ``where`` now (the driver's count, so memory that Paddle holds is not
    free); None on the CPU, whose KV cache is sized by ``--kv-cache-mb``."""
    if where == "cpu":
        return None
    import paddle

    index = _index(where)
    if hasattr(paddle, "cuda") and hasattr(paddle.cuda, "mem_get_info"):  # 3.x; 2.6 has no mem_get_info
        return int(paddle.cuda.mem_get_info(index)[0])
    total = paddle.device.cuda.get_device_properties(index).total_memory
    return int(total - paddle.device.cuda.memory_reserved(index))


def _index(where: str) -> int:
    return int(where.removeprefix("gpu:"))


def count_gpus(
    env: Mapping[str, str] = os.environ, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
) -> int:
    """GPUs this machine offers a process, without importing Paddle (``splitbus up`` asks before
    starting workers): the entries of ``CUDA_VISIBLE_DEVICES`` when it is set, else the GPUs that
    ``nvidia-smi -L`` lists; 0 when neither tells (no driver, no GPU)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        return entries.index("-1") if "-1" in entries else len(entries)  # CUDA stops at "-1"
    try:
        listed = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0
