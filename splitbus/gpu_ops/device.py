"""Process set-up for Paddle: CPU settings that must precede ``import paddle``, and the device.

Measured on 2 vCPU (see ../shared/NOTES-paddle.md): these settings make CPU inference ~4x faster.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
ONE_GIB = 1 << 30


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


def select_device(threads: int = 1) -> str:
    """The GPU when Paddle sees one, else the CPU with ``threads`` math threads."""
    import paddle

    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        paddle.set_device("gpu:0")
        return "gpu:0"
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
