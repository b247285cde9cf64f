"""Hugging Face safetensors -> float32 arrays, every name and shape checked first against the
tensors the model's architecture lists (``Architecture.tensor_shapes``)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np
import paddle
from safetensors import safe_open

from splitbus.architectures import ModelConfig
from splitbus.tokenization import ModelFilesError


def _files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFilesError(f"{folder} holds no *.safetensors file")
    return files


def _index(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in _files(folder):
        try:
            with safe_open(str(path), framework="paddle") as f:
                for name in f.keys():
                    found[name] = (path, tuple(f.get_slice(name).get_shape()))
        except Exception as exc:  # safetensors raises its own error types
            raise ModelFilesError(f"{path} cannot be read: {exc}") from None
    return found


def check(folder: Path, config: ModelConfig) -> dict[str, Path]:
    """Where each needed tensor is; ModelFilesError naming the first problems otherwise."""
    found = _index(folder)
    problems = []
    shapes = config.tensor_shapes()
    for name, shape in shapes.items():
        if name not in found:
            problems.append(f"missing tensor {name}")
        elif found[name][1] != shape:
            problems.append(f"tensor {name} has shape {list(found[name][1])}, expected {list(shape)} from config.json")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ModelFilesError(f"{folder}: " + "; ".join(problems[:5]) + more)
    return {name: found[name][0] for name in shapes}


def load(folder: Path, config: ModelConfig, skip: Collection[str] = ()) -> Iterator[tuple[str, np.ndarray]]:
    """Each needed tensor but those in ``skip`` (other ranks' experts) as float32 numpy (bf16 and
    fp16 are converted on the CPU). Every tensor is checked, read or skipped.

    safetensors' Paddle reader (the one that reads bf16) reinterprets bytes with a strided view,
    which the engine's CPU tuning switches off (FLAGS_use_stride_kernel=0); it is switched back
    on for the load only.
    """
    by_file: dict[Path, list[str]] = {}
    for name, path in check(folder, config).items():
        if name not in skip:
            by_file.setdefault(path, []).append(name)
    with _stride_kernels():
        for path, names in by_file.items():
            with safe_open(str(path), framework="paddle") as f:
                for name in names:
                    yield name, f.get_tensor(name).astype(paddle.float32).numpy()


@contextlib.contextmanager
def _stride_kernels() -> Iterator[None]:
    flag = "FLAGS_use_stride_kernel"
    before = paddle.get_flags([flag])[flag]
    paddle.set_flags({flag: True})
    try:
        yield
    finally:
        paddle.set_flags({flag: before})
