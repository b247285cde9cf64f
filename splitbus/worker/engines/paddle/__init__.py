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
from splitbus.worker.engines.base import GPU_MEMORY_FRACTION

if TYPE_CHECKING:  # types only: the registry imports this package to build the CLI's parser
    import argparse
    from pathlib import Path

    from splitbus.architectures import ModelConfig
    from splitbus.worker.engines import Engine

from splitbus.worker.engines.paddle.dtypes import KV_DTYPE, compute_dtype

CPU_KV_CACHE_BYTES: Final = 256 * 2**20
"""The KV cache's memory on the CPU without ``--kv-cache-mb`` (or ``--kv-blocks``)."""
KV_SHARE: Final = 0.9
"""The part of a worker's GPU memory (``--gpu-memory-fraction`` of the GPU, less its weights) that
the KV cache takes without ``--kv-cache-mb`` (or ``--kv-blocks``): the rest is headroom for a
step's activations."""


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
    """KV blocks of ``block_size`` tokens that ``budget_bytes`` holds for ``model`` in ``dtype``.
    ValueError when that is fewer than 2 (block 0 is the cache's scratch block: one is no cache)."""
    per_token = kv_bytes_per_token(model.layers, model.kv_heads, model.head_dim, dtype)
    blocks = budget_bytes // (per_token * block_size)
    if blocks < 2:
        need = -(-2 * per_token * block_size // 2**20)
        raise ValueError(
            f"the KV cache's budget, {budget_bytes / 2**20:.1f} MiB, holds {blocks} block(s) of {block_size} tokens; "
            f"it needs 2 ({need} MiB): give more --kv-cache-mb, or more --gpu-memory-fraction on a GPU"
        )
    return blocks


def kv_budget(where: str, kv_cache_bytes: int | None, fraction: float = GPU_MEMORY_FRACTION) -> int:
    """Bytes the KV cache may take on ``where`` (``device.select_device``'s answer), asked once
    the weights are loaded: ``kv_cache_bytes`` when given (``--kv-cache-mb``); on the CPU
    ``CPU_KV_CACHE_BYTES``; on a GPU ``KV_SHARE`` of this worker's share of it, ``fraction``
    (``--gpu-memory-fraction``) of its total memory, less what the worker holds there (its
    weights). Like vLLM's ``--gpu-memory-utilization``, the share is of the total, not of what is
    free, so workers that start together on one GPU, each told its part, do not race for it."""
    from splitbus.gpu_ops import device

    if kv_cache_bytes is not None:
        return kv_cache_bytes
    memory = device.gpu_memory(where)
    if memory is None:
        return CPU_KV_CACHE_BYTES
    total, held = memory
    return max(0, int((fraction * total - held) * KV_SHARE))


def _blocks_on(model: ModelConfig, setup: EngineSetup, where: str) -> int:
    """The KV blocks of ``setup`` on ``where``, in the dtype the model computes in there."""
    budget = kv_budget(where, setup.kv_cache_bytes, setup.gpu_memory_fraction)
    return kv_blocks(model, budget, setup.block_size, compute_dtype(where))


@register
class PaddleType(EngineType):
    name = "paddle"
    capabilities = Capabilities(real_weights=True, needs_paddle=True, expert_parallel=True)
    kv_blocks_default = "from --kv-cache-mb, or --gpu-memory-fraction of a GPU"

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
