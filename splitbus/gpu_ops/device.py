"""Process set-up for Paddle: CPU settings that must precede ``import paddle``, and the device.

Measured on 2 vCPU: these settings make CPU inference ~4x faster. The device is named as the
worker's ``--device`` names it: ``auto``, ``cpu`` or ``gpu:N``. What reads a GPU (its count, compute
capability, its memory) is behind the functions here, and has never run on a GPU: this project's
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


def gpu_memory(where: str) -> tuple[int, int] | None:
    """(total bytes of the GPU ``where``, bytes this process holds on it), asked once the weights
    are loaded; None on the CPU, whose KV cache is sized by ``--kv-cache-mb``. What this process
    holds is Paddle's allocator's reservation once its cache of freed blocks is given back (what
    loading left behind is not the weights'); neither count depends on what other processes hold
    at the moment, so workers that start together on one GPU size alike. Paddle 2.6 and 3.x both
    have these calls (2.6 has no ``mem_get_info``)."""
    if where == "cpu":
        return None
    import paddle

    index = _index(where)
    paddle.device.cuda.empty_cache()
    total = int(paddle.device.cuda.get_device_properties(index).total_memory)
    return total, int(paddle.device.cuda.memory_reserved(index))


def _index(where: str) -> int:
    return int(where.removeprefix("gpu:"))


def count_gpus(
    env: Mapping[str, str] = os.environ, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
) -> int:
    """GPUs this machine offers a process, without importing Paddle (``splitbus up`` asks before
    starting workers): the GPUs that ``nvidia-smi -L`` lists (0 when it fails: no driver, no GPU),
    or as many of them as ``CUDA_VISIBLE_DEVICES`` lets through when it is set."""
    try:
        listed = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)
        lines = listed.stdout.splitlines() if listed.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        lines = []
    gpus = sum(line.startswith("GPU ") for line in lines)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return gpus if visible is None else visible_gpus(visible, gpus)


def visible_gpus(visible: str, gpus: int) -> int:
    """The GPUs ``CUDA_VISIBLE_DEVICES=visible`` makes visible where ``gpus`` are installed, read
    as CUDA reads it: entries up to the first invalid one, which is an empty entry, an index out
    of range (or negative, like ``-1``), an index or UUID already given, or neither an index nor a
    ``GPU-``/``MIG-`` UUID. A UUID is taken on trust (only the driver knows which exist), but
    never more GPUs than are installed."""
    seen: set[str] = set()
    for entry in (e.strip() for e in visible.split(",")):
        name = str(int(entry)) if entry.isdigit() else entry  # "01" is GPU 1
        if name in seen or not (entry.isdigit() and int(entry) < gpus or entry.startswith(("GPU-", "MIG-"))):
            break
        seen.add(name)
    return min(len(seen), gpus)
