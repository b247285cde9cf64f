"""What an engine module builds on: the type it registers (``EngineType``), the capability
flags that decide what else may rely on it, what it is built from (``EngineSetup``), and the
arithmetic of KV sizing. The interface the worker loop calls is ``interface.Engine``.

An engine module (one file under ``worker/engines/``) defines an ``EngineType`` subclass and
decorates it with ``@register`` (see ``worker/engines/__init__.py``); the worker CLI then offers it
under ``--engine``, adds its options and builds it with ``create``.
"""

from __future__ import annotations

import argparse
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # types only: the CLI imports the registry to build its parser, which stays fast
    from splitbus.tokenization import ModelTokenizer
    from splitbus.worker.engines.interface import Engine

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
"""Bytes per element of the dtypes a KV cache may hold (numpy knows no bfloat16 or float8)."""
GPU_MEMORY_FRACTION = 0.9
"""``--gpu-memory-fraction``'s default: a worker alone on its GPU may take 90% of its memory."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, for the code that used to test its name."""

    real_weights: bool = False
    """It runs the model folder's weights (``*.safetensors``); False: it needs the folder's
    tokenizer and ``config.json`` only. ``splitbus up`` makes its default tiny model with
    random weights only for such an engine."""
    needs_paddle: bool = False
    """It imports PaddlePaddle: the worker applies the CPU tuning (``gpu_ops.device.prepare``),
    which must precede paddle's import, before creating it."""
    kv_transfer: bool = True
    """``export_kv`` and ``import_kv`` work: it can be a prefill or a decode worker, not only mixed."""
    expert_parallel: bool = False
    """It can split a MoE model's experts over a DP group's ranks (``--ep``): it builds from
    ``EngineSetup.shard`` and is an ``interface.ExpertParallel``."""
    simulated_group: bool = False
    """It has no EP whose all-to-all would make a DP group's ranks finish each step together,
    so a group of it ends each step at a barrier instead (``DpStepper.steps_end_together``):
    tokens come out when the group's step ends, as they would with EP."""


@dataclass(frozen=True)
class EngineSetup:
    """What every engine is built from: the worker's model and the resources it may use."""

    model_dir: Path
    tokenizer: ModelTokenizer
    block_size: int = 16
    """Tokens per KV block (the scheduler counts reservations in these)."""
    kv_blocks: int | None = None
    """KV blocks to allocate (``--kv-blocks``); None: the engine sizes its cache itself, from
    ``kv_cache_bytes`` and its model, or by its own default."""
    kv_cache_bytes: int | None = None
    """Memory the KV cache may take (``--kv-cache-mb``) when ``kv_blocks`` is None; None: the
    engine's default (paddle: 256 MiB on the CPU, from ``gpu_memory_fraction`` on a GPU)."""
    gpu_memory_fraction: float = GPU_MEMORY_FRACTION
    """The part of a GPU's total memory this worker may take, weights included
    (``--gpu-memory-fraction``; ``splitbus up`` divides it among the workers that share a GPU),
    when ``kv_blocks`` and ``kv_cache_bytes`` are None. Not used on the CPU."""
    device: str = "auto"
    """Where an engine that computes runs (``--device``): ``auto``, ``cpu`` or ``gpu:N``."""
    threads: int = 1
    """Math threads on the CPU (1 when several workers share few cores)."""
    shard: tuple[int, int] = (0, 1)
    """(rank, ranks) of an expert-parallel group: the engine holds that rank's share of the
    experts; (0, 1): every expert."""
    options: object = None
    """The engine's own options, as its ``options_from`` made them; None: its defaults."""

    def __post_init__(self) -> None:
        from splitbus.gpu_ops.device import parse_device  # plain Python: no paddle

        if self.block_size < 1 or any(n is not None and n < 1 for n in (self.kv_blocks, self.kv_cache_bytes)):
            raise ValueError("capacities must be >= 1")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"the GPU memory fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        parse_device(self.device)


class EngineType(ABC):
    """One kind of engine as the registry knows it: its name, what it can do, its CLI options
    and how to build it. Called by the worker CLI, in this order: ``add_arguments`` once when
    the parser is built (for every registered engine), then, for the engine chosen,
    ``options_from`` and ``create``."""

    name: ClassVar[str]
    """What ``--engine`` calls it."""
    capabilities: ClassVar[Capabilities]
    kv_blocks_default: ClassVar[str]
    """How it sizes its KV cache without ``--kv-blocks``, for that option's help ("8192")."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this engine's own options to the worker's parser (named ``--<name>-...``)."""
        return None  # most engines have none

    def options_from(self, args: argparse.Namespace) -> object:
        """This engine's options from the parsed arguments; becomes ``EngineSetup.options``."""
        return None

    def make_default_model(self, folder: Path) -> None:
        """Write the model ``splitbus up`` serves when given none, into the empty ``folder``;
        called once, on the first run. By default a byte-level tokenizer and a ``config.json``,
        which is all an engine without real weights reads; one with weights writes them too."""
        from splitbus import architectures
        from splitbus.tokenization.byte_level import write_byte_level_tokenizer

        vocab = write_byte_level_tokenizer(folder)
        hf_name = architectures.of_model_type(architectures.DEFAULT).hf_name
        config = {"architectures": [hf_name], "max_position_embeddings": 4096, "vocab_size": vocab}
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    @abstractmethod
    def create(self, setup: EngineSetup) -> Engine:
        """Build the engine, its KV cache sized from ``setup``. Raises ValueError (or
        ``ModelFilesError``) with a message for the user when it cannot."""


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes one token takes in a KV cache: K and V of every layer, in ``dtype``."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]
