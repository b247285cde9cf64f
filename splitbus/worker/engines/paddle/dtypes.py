"""The dtype the paddle engine's KV cache holds (its model's config is ``splitbus.architectures``)."""

from __future__ import annotations

from typing import Final

KV_DTYPE: Final = "float32"
"""The KV cache's dtype: the model computes in float32 (bf16 and fp16 weights are converted as
they load), so its K and V are float32. Sizing (``kv_blocks``) and the cache (``new_cache``) both
read it."""
