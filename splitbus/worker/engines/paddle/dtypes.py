"""The dtype the paddle engine computes in, and so its weights and KV cache hold (its model's
config is ``splitbus.architectures``). Plain Python: the package imports it without paddle."""

from __future__ import annotations

from typing import Final, Literal

from splitbus.gpu_ops import device

KV_DTYPE: Final = "float32"
"""The dtype on a device without bfloat16 (the CPU, a GPU before compute capability 8): bf16 and
fp16 weights are converted to it as they load, so K and V are float32 too."""
BF16: Final = "bfloat16"
"""The dtype on a GPU that computes bfloat16: half float32's memory for weights and KV."""


def compute_dtype(where: str) -> Literal["float32", "bfloat16"]:
    """The dtype of the weights and the KV cache on ``where`` (``device.select_device``'s answer):
    sizing (``kv_blocks``) and the cache (``CausalLM.new_cache``) both read the model's choice."""
    return BF16 if device.computes_bf16(where) else KV_DTYPE
