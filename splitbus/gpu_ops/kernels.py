"""The operations a device may have fused kernels for, behind one interface: RMSNorm, the SwiGLU
activation, RoPE and attention.

``Kernels`` is the batched Paddle-op path, which runs everywhere. ``available`` probes Paddle's fused
kernels once on the device in use (a call on tiny tensors: an op with no kernel there raises) and
returns the ``Kernels`` that uses each one found, the Paddle-op path for the rest:

- ``fused_rms_norm`` and ``swiglu`` have CPU kernels too;
- ``fused_rotary_position_embedding`` (given its tables) and ``flash_attn_unpadded`` exist only in
  GPU builds. Neither has ever run here: the project's machines have no GPU (docs/engine.md).

A model runs ``chosen()`` (every fused kernel found) unless told otherwise (``KERNELS``); the probe
runs once per process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import paddle
import paddle.nn.functional as F

from splitbus.gpu_ops import layers
from splitbus.gpu_ops.attention import Plan, batched_attention
from splitbus.gpu_ops.kv_cache import KVDtype

log = logging.getLogger(__name__)

Op = Callable[..., paddle.Tensor]


def _fused_rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    from paddle.incubate.nn.functional import fused_rms_norm

    return fused_rms_norm(x, weight, None, eps, len(x.shape) - 1)[0]


def _fused_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """x ``[T, heads, head_dim]``, cos and sin ``[T, 1, head_dim]``; rotate-half (not NeoX's
    interleaved pairs: ``use_neox_rotary_style=False``)."""
    from paddle.incubate.nn.functional import fused_rotary_position_embedding

    tokens, dim = x.shape[0], x.shape[-1]
    sin, cos = sin.reshape([1, tokens, 1, dim]), cos.reshape([1, tokens, 1, dim])
    out = fused_rotary_position_embedding(x.unsqueeze(0), sin=sin, cos=cos, use_neox_rotary_style=False)[0]
    return out.squeeze(0)


def _flash_attention(q: paddle.Tensor, k_source: paddle.Tensor, v_source: paddle.Tensor, layout: Plan) -> paddle.Tensor:
    """Every chunk's queries against its keys, unpadded: the keys gathered once into runs
    (``Plan.packed``). Paddle's FlashAttention fork aligns its causal mask top-left, so the plan
    has an unpadded layout only for steps where that is right (``Packed.causal``); the others run
    the batched Paddle ops."""
    from paddle.nn.functional.flash_attention import flash_attn_unpadded

    packed = layout.packed
    if packed is None:
        return batched_attention(q, k_source, v_source, layout)
    k, v = (paddle.index_select(s, packed.key_rows, axis=0) for s in (k_source, v_source))
    dim = q.shape[-1]
    out = flash_attn_unpadded(
        q, k, v, packed.cu_queries, packed.cu_keys, packed.max_queries, packed.max_keys, dim**-0.5,
        causal=packed.causal, training=False,
    )[0]  # fmt: skip
    return out.reshape([q.shape[0], q.shape[1] * dim])


@dataclass(frozen=True)
class Kernels:
    """The ops the model's layers call; each field is one op, Paddle's fused kernel or the plain path."""

    rms_norm: Op = layers.rms_norm
    """``(x, weight, eps)``: RMSNorm over the last axis."""
    swiglu: Op = layers.silu_and_mul
    """``(gate_up)``: ``silu(gate) * up`` of the fused projections."""
    rope: Op = layers.apply_rope
    """``(x [T, heads, dim], cos, sin)``: rotate-half RoPE."""
    attention: Op = batched_attention
    """``(q, k_source, v_source, plan)`` (``splitbus.gpu_ops.attention``)."""
    fused: tuple[str, ...] = field(default=())
    """The fused kernels in use, by Paddle's names."""

    @property
    def name(self) -> str:
        return "+".join(self.fused) if self.fused else "paddle"

    @property
    def unpadded(self) -> bool:
        """Whether its attention reads the plan's unpadded layout (``Plan.packed``)."""
        return "flash_attn_unpadded" in self.fused


FUSED: dict[str, tuple[str, Op]] = {
    "fused_rms_norm": ("rms_norm", _fused_rms_norm),
    "swiglu": ("swiglu", F.swiglu),
    "fused_rotary_position_embedding": ("rope", _fused_rope),
    "flash_attn_unpadded": ("attention", _flash_attention),
}
"""Paddle's fused kernels by name: the ``Kernels`` field each replaces, and the op."""


def _probes(dtype: KVDtype) -> dict[str, Callable[[], object]]:
    """A call of each fused kernel on tiny tensors of the device in use, in the model's ``dtype``
    (head_dim 64). FlashAttention has only 16-bit kernels: a float32 model has no probe of it."""
    x = paddle.ones([2, 2, 64], dtype)
    tables = paddle.ones([2, 1, 64], dtype)
    probes: dict[str, Callable[[], object]] = {
        "fused_rms_norm": lambda: _fused_rms_norm(x, paddle.ones([64], dtype), 1e-6),
        "swiglu": lambda: F.swiglu(x),
        "fused_rotary_position_embedding": lambda: _fused_rope(x, tables, tables),
    }
    if dtype in ("float16", "bfloat16"):
        probes["flash_attn_unpadded"] = lambda: _flash_probe(x)
    return probes


def _flash_probe(x: paddle.Tensor) -> object:
    from paddle.nn.functional.flash_attention import flash_attn_unpadded

    cu = paddle.to_tensor(np.array([0, 2], dtype=np.int32))
    return flash_attn_unpadded(x, x, x, cu, cu, 2, 2, 0.125, causal=True, training=False)


@functools.cache
def available(dtype: KVDtype = "float32") -> tuple[str, ...]:
    """The fused kernels the device in use has for a model in ``dtype``: each is called once;
    one that raises is not."""
    found = []
    for name, probe in _probes(dtype).items():
        try:
            probe()
        except Exception as exc:  # noqa: BLE001 - a kernel missing on this device raises a NotFound, or worse
            log.debug("no %s here: %s", name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        else:
            found.append(name)
    return tuple(found)


def with_fused(names: tuple[str, ...]) -> Kernels:
    """The Paddle-op path with the named fused kernels in place of the ops they replace."""
    unknown = [n for n in names if n not in FUSED]
    if unknown:
        raise ValueError(f"unknown fused kernels {unknown}: the known are {sorted(FUSED)}")
    ops = {FUSED[n][0]: FUSED[n][1] for n in names}
    return replace(Kernels(), fused=names, **ops)


KERNELS: dict[str, Callable[[KVDtype], Kernels]] = {
    "auto": lambda dtype: with_fused(available(dtype)),
    "paddle": lambda dtype: Kernels(),
}
"""``--paddle-kernels`` choices, each made for a model's dtype: ``auto`` uses every fused kernel
the device has for it; ``paddle`` none (and probes nothing)."""


def chosen(name: str = "auto", dtype: KVDtype = "float32") -> Kernels:
    """``KERNELS[name]`` for a model in ``dtype``."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernels {name!r}: choose one of {sorted(KERNELS)}")
    return KERNELS[name](dtype)
