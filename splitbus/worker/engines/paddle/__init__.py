"""The PaddlePaddle engine: the registered architectures (``splitbus.architectures``) from a
Hugging Face folder, on gpu_ops.

Importing this package imports no paddle (the registry imports it to learn the engine's name):
``dtypes`` is plain Python; ``engine``, ``model`` and ``weights`` import paddle and are imported
by ``PaddleType.create``, after the worker's CPU tuning.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Final

from splitbus.worker.engines import Capabilities, EngineSetup, EngineType, kv_bytes_per_token, register

if TYPE_CHECKING:  # types only: the registry imports this package to build the CLI's parser
    import argparse
    from pathlib import Path

    from splitbus.architectures import ModelConfig
    from splitbus.worker.engines import Engine

from splitbus.worker.engines.paddle.dtypes import KV_DTYPE, compute_dtype

CPU_KV_CACHE_BYTES: Final = 256 * 2**20
"""The KV cache's memory on the CPU without ``--kv-cache-mb`` (or ``--kv-blocks``)."""
GPU_FREE_FRACTION: Final = 0.9
"""The share of a GPU's free memory, once the weights are loaded, that the KV cache takes without
``--kv-cache-mb`` (or ``--kv-blocks``): the rest is headroom for a step's activations."""


KERNEL_CHOICES: Final = ("auto", "paddle")
"""``--paddle-kernels``: the names of ``splitbus.gpu_ops.kernels.KERNELS``, written out here because
the worker's parser is built without importing paddle (a test holds the two equal)."""


@dataclass(frozen=True)
class PaddleOptions:
    """The paddle engine's own options."""

    kernels: str = "auto"
    """``--paddle-kernels``: ``auto``, Paddle's fused kernels where the device has them (the batched
    Paddle ops for the rest); ``paddle``, the batched Paddle ops only."""


def kv_blocks(model: ModelConfig, budget_bytes: int, block_size: int, dtype: str = KV_DTYPE) -> int:
    """KV blocks of ``block_size`` tokens that ``budget_bytes`` holds for ``model`` in ``dtype``;
    at least 2 (block 0 is the cache's scratch block)."""
    per_token = kv_bytes_per_token(model.layers, model.kv_heads, model.head_dim, dtype)
    return max(2, budget_bytes // (per_token * block_size))


def kv_budget(where: str, kv_cache_bytes: int | None) -> int:
    """Bytes the KV cache may take on ``where`` (``device.select_device``'s answer), asked once
    the weights are loaded: ``kv_cache_bytes`` when given (``--kv-cache-mb``), else
    ``GPU_FREE_FRACTION`` of what a GPU has free, or ``CPU_KV_CACHE_BYTES`` on the CPU."""
    from splitbus.gpu_ops import device

    if kv_cache_bytes is not None:
        return kv_cache_bytes
    free = device.free_bytes(where)
    return CPU_KV_CACHE_BYTES if free is None else int(free * GPU_FREE_FRACTION)


def _blocks_on(model: ModelConfig, setup: EngineSetup, where: str) -> int:
    """The KV blocks of ``setup`` on ``where``, in the dtype the model computes in there."""
    return kv_blocks(model, kv_budget(where, setup.kv_cache_bytes), setup.block_size, compute_dtype(where))


@register
class PaddleType(EngineType):
    name = "paddle"
    capabilities = Capabilities(real_weights=True, needs_paddle=True, expert_parallel=True)
    kv_blocks_default = "from --kv-cache-mb, or a GPU's free memory"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--paddle-kernels",
            choices=KERNEL_CHOICES,
            default=PaddleOptions.kernels,
            help="auto: Paddle's fused kernels where the device has them (RMSNorm and SwiGLU on the CPU); "
            "paddle: plain Paddle ops only (default %(default)s)",
        )

    def options_from(self, args: argparse.Namespace) -> PaddleOptions:
        return PaddleOptions(args.paddle_kernels)

    def make_default_model(self, folder: Path) -> None:
        from splitbus.gpu_ops import device

        device.prepare()  # the CPU tuning comes before paddle's import
        from splitbus.worker.engines.paddle.tiny import make_tiny_model

        make_tiny_model(folder)

    def create(self, setup: EngineSetup) -> Engine:
        from splitbus.architectures import load_config

        try:
            from splitbus.worker.engines.paddle.engine import PaddleEngine
        except ImportError as exc:
            raise ValueError(f"the paddle engine needs PaddlePaddle: pip install 'splitbus[paddle]' ({exc})") from None
        blocks = setup.kv_blocks or partial(_blocks_on, load_config(setup.model_dir), setup)
        return PaddleEngine.load(
            setup.model_dir,
            setup.tokenizer.eos_token_ids,
            blocks,
            setup.block_size,
            setup.threads,
            setup.shard,
            setup.device,
            setup.options.kernels if isinstance(setup.options, PaddleOptions) else PaddleOptions.kernels,
        )
