"""Paddle's fused kernels against the plain Paddle-op path they replace (``splitbus.gpu_ops.kernels``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import pytest

from splitbus.gpu_ops import kernels
from splitbus.gpu_ops.attention import Run, plan
from splitbus.gpu_ops.kernels import FUSED, Kernels, chosen, with_fused
from splitbus.worker.engines.paddle.model import CausalLM, Chunk
from splitbus.worker.engines.paddle.tiny import make_tiny_model, tiny_config

GPU_ONLY = {"fused_rotary_position_embedding", "flash_attn_unpadded"}


def test_the_probe_finds_the_cpu_kernels_and_not_the_gpu_only_ones() -> None:
    if paddle.device.is_compiled_with_cuda():
        pytest.skip("a GPU build: the GPU-only kernels may be there")
    assert set(kernels.available()) == set(FUSED) - GPU_ONLY
    assert chosen().fused == kernels.available() and chosen("paddle").fused == ()


@pytest.mark.parametrize("shape", [(5, 64), (7, 3, 32)])
def test_fused_rms_norm_matches_the_plain_ops(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(shape))
    x = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
    w = paddle.to_tensor(rng.standard_normal(shape[-1]).astype(np.float32))
    fused = with_fused(("fused_rms_norm",)).rms_norm(x, w, 1e-6).numpy()
    np.testing.assert_allclose(fused, Kernels().rms_norm(x, w, 1e-6).numpy(), rtol=1e-5, atol=1e-5)


def test_fused_swiglu_matches_silu_times_up() -> None:
    gate_up = paddle.to_tensor(np.random.default_rng(3).standard_normal((9, 2 * 48)).astype(np.float32))
    fused = with_fused(("swiglu",)).swiglu(gate_up).numpy()
    np.testing.assert_allclose(fused, Kernels().swiglu(gate_up).numpy(), rtol=1e-5, atol=1e-6)


def test_unknown_kernels_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown fused kernels"):
        with_fused(("fused_rms_norm", "warp_drive"))
    with pytest.raises(ValueError, match="unknown kernels 'fast'"):
        chosen("fast")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_model_on_the_fused_kernels_gives_the_plain_paths_logits_and_greedy_tokens(arch: str) -> None:
    config = tiny_config(arch, 259)
    rng = np.random.default_rng(5)
    from splitbus.architectures import config_from

    tensors = {
        n: 0.05 * rng.standard_normal(s).astype(np.float32) for n, s in config_from(config).tensor_shapes().items()
    }
    plain, fused = CausalLM(config_from(config), tensors), CausalLM(config_from(config), tensors)
    plain.kernels, fused.kernels = Kernels(), chosen()
    assert fused.kernels.fused  # this device has some: the comparison compares something
    runs = []
    for model in (plain, fused):
        cache, tokens = model.new_cache(12, 4), [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]]
        tables = [cache.allocator.allocate(5) for _ in tokens]
        logits = model.forward([Chunk(t, 0, tb) for t, tb in zip(tokens, tables, strict=True)], cache)
        out = [logits]
        for _ in range(6):
            nxt = logits.argmax(-1)
            chunks = [Chunk([int(n)], len(t), tb) for n, t, tb in zip(nxt, tokens, tables, strict=True)]
            tokens = [[*t, int(n)] for t, n in zip(tokens, nxt, strict=True)]
            logits = model.forward(chunks, cache)
            out.append(logits)
        runs.append((out, tokens))
    (plain_logits, plain_tokens), (fused_logits, fused_tokens) = runs
    assert plain_tokens == fused_tokens
    for a, b in zip(plain_logits, fused_logits, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_the_unpadded_layout_gives_each_run_its_queries_and_keys() -> None:
    """What FlashAttention's varlen kernel would read: run i's queries are rows cu_q[i]..cu_q[i+1]
    of the packed queries and its keys rows cu_k[i]..cu_k[i+1] of key_rows, by position."""
    runs = [Run(0, 0, 3, np.array([9, 4, 7])), Run(3, 0, 1, np.array([20])), Run(4, 0, 2, np.array([1, 2]))]
    packed = plan(runs, 4, key_pad=0, total=6, unpadded=True).packed
    assert packed is not None
    assert packed.cu_queries.numpy().tolist() == [0, 3, 4, 6]
    assert packed.cu_keys.numpy().tolist() == [0, 3, 4, 6]
    assert packed.key_rows.numpy().tolist() == [9, 4, 7, 20, 1, 2]
    assert (packed.max_queries, packed.max_keys, packed.causal) == (3, 3, True)
    assert packed.cu_queries.dtype == paddle.int32 and packed.cu_keys.dtype == paddle.int32
    decodes = [Run(0, 5, 1, np.arange(6)), Run(1, 2, 1, np.arange(10, 13))]
    packed = plan(decodes, 4, key_pad=0, total=2, unpadded=True).packed
    assert packed is not None and packed.cu_keys.numpy().tolist() == [0, 6, 9] and not packed.causal


def test_the_worker_offers_exactly_the_registered_kernels() -> None:
    """The CLI's choices are written out (its parser is built without paddle): they must be the registry's."""
    from splitbus.worker.engines.paddle import KERNEL_CHOICES

    assert set(KERNEL_CHOICES) == set(kernels.KERNELS)


def test_the_engine_loads_with_the_kernels_it_is_told(tmp_path: Path) -> None:
    from splitbus.worker.engines.paddle.engine import PaddleEngine

    folder = make_tiny_model(tmp_path / "tiny", "llama", seed=2)
    plain = PaddleEngine.load(folder, (0,), 8, 4, kernels="paddle")
    fused = PaddleEngine.load(folder, (0,), 8, 4)
    assert plain.model.kernels == Kernels() and fused.model.kernels == chosen()


def _top_left_flash(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=False, training=True):  # type: ignore[no-untyped-def]
    """Paddle's FlashAttention fork as its kernel masks: query i of a run sees keys 0..i (top-left)."""
    q, k, v, cu_q, cu_k = (t.numpy() for t in (q, k, v, cu_q, cu_k))
    group, out = q.shape[1] // k.shape[1], np.zeros_like(q)
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        for h in range(q.shape[1]):
            scores = qi[:, h] @ ki[:, h // group].T * scale
            if causal:
                scores[np.arange(ki.shape[0])[None, :] > np.arange(qi.shape[0])[:, None]] = -np.inf
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[cu_q[i] : cu_q[i + 1], h] = (p / p.sum(-1, keepdims=True)) @ vi[:, h // group]
    return paddle.to_tensor(out), None


@pytest.mark.parametrize(
    "shapes, unpadded",
    [([(0, 5), (0, 9), (0, 1)], True), ([(7, 1), (30, 1), (2, 1)], True), ([(0, 5), (12, 3), (20, 1)], False)],
    ids=["fresh prompts", "decodes", "prefix-cached and mixed"],
)
def test_the_flash_path_is_right_under_a_top_left_causal_mask(
    shapes: list[tuple[int, int]], unpadded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh prompts run it causal, decodes without a mask; a step where a top-left mask would be
    wrong (queries after a cached prefix) has no unpadded layout and runs the batched ops."""
    import paddle.nn.functional.flash_attention as flash

    calls: list[bool] = []
    monkeypatch.setattr(
        flash, "flash_attn_unpadded", lambda *a, **kw: calls.append(kw["causal"]) or _top_left_flash(*a, **kw)
    )
    rng = np.random.default_rng(len(shapes))
    runs, first, free = [], 0, rng.permutation(np.arange(1, 512))
    for start, queries in shapes:
        runs.append(Run(first, start, queries, free[: start + queries]))
        free, first = free[start + queries :], first + queries
    q = rng.standard_normal((first, 4, 8)).astype(np.float32)
    pool = rng.standard_normal((2, 512, 2, 8)).astype(np.float32)
    layout = plan(runs, 4, 0, first, unpadded=True)
    assert (layout.packed is not None) == unpadded
    got = with_fused(("flash_attn_unpadded",)).attention(paddle.to_tensor(q), *map(paddle.to_tensor, pool), layout)
    expected = Kernels().attention(paddle.to_tensor(q), *map(paddle.to_tensor, pool), plan(runs, 4, 0, first))
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=2e-5)
    assert calls == ([any(queries > 1 for _, queries in shapes)] if unpadded else [])
