"""Mixtral and Qwen3-MoE in the paddle engine against an independent numpy reference.

The reference is written here from the equations of Hugging Face transformers' modeling code
(``modeling_mixtral.py``, ``modeling_qwen3_moe.py``), not from the engine: RMSNorm
``x / sqrt(mean(x^2) + eps) * w``; rotate-half RoPE; grouped-query causal attention with scores
scaled by ``1/sqrt(head_dim)`` (Qwen3: RMSNorm on each q and k head before RoPE); per layer
``x += attn(norm1(x))`` then ``x += mlp(norm2(x))``, where an MoE block takes the softmax of the
router logits over every expert, keeps the top ``num_experts_per_tok``, divides those by their sum
(Mixtral always, Qwen3 when ``norm_topk_prob``), and adds each chosen expert's
``down(silu(gate h) * up h)`` times its weight; Qwen3 keeps a dense MLP in the layers
``mlp_only_layers`` lists or that ``decoder_sparse_step`` skips; the LM head after the final norm.
Float64 throughout, from the checkpoint's own safetensors file.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file

from splitbus import architectures
from splitbus.gpu_ops import moe
from splitbus.tokenization import ModelFilesError
from splitbus.worker.engines.paddle.model import Chunk, Experts, load_model
from splitbus.worker.engines.paddle.tiny import make_tiny_model

ATOL = 1e-4  # as the engine's paged-vs-contiguous logits test compares

MOE_BLOCKS = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
"""model_type -> the MoE block's name in a layer and its experts' gate, up and down projections."""


def _tiny(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(arch) / "m", arch, seed=4, hidden=64, layers=2)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "mixtral")


@pytest.fixture(scope="module", params=sorted(MOE_BLOCKS))
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, request.param)


class Reference:
    """Mixtral's or Qwen3-MoE's forward in numpy (float64) over one sequence."""

    def __init__(self, folder: Path) -> None:
        self.c = json.loads((folder / "config.json").read_text())
        self.t = {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
        self.block, self.projections = MOE_BLOCKS[self.c["model_type"]]
        self.renormalise = self.c["model_type"] == "mixtral" or self.c["norm_topk_prob"]
        self.routed: set[tuple[int, int]] = set()  # (layer, expert) pairs that took a token
        self.took: Counter[int] = Counter()  # tokens each expert took, every MoE layer's added

    def is_moe(self, layer: int) -> bool:
        """Qwen3MoeDecoderLayer's rule; Mixtral's config has neither key: every layer."""
        dense = layer in self.c.get("mlp_only_layers", [])
        return not dense and (layer + 1) % self.c.get("decoder_sparse_step", 1) == 0

    def norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.c["rms_norm_eps"]) * w

    def rope(self, x: np.ndarray) -> np.ndarray:
        """x [seq, heads, dim], rotate_half with cos = cat(freqs, freqs)."""
        dim = x.shape[-1]
        inv = 1.0 / self.c["rope_theta"] ** (np.arange(0, dim, 2) / dim)
        freqs = np.outer(np.arange(x.shape[0]), inv)
        cos, sin = (
            np.cos(np.concatenate([freqs, freqs], -1))[:, None],
            np.sin(np.concatenate([freqs, freqs], -1))[:, None],
        )
        rotated = np.concatenate([-x[..., dim // 2 :], x[..., : dim // 2]], axis=-1)
        return x * cos + rotated * sin

    def attention(self, h: np.ndarray, p: str) -> np.ndarray:
        heads, kv = self.c["num_attention_heads"], self.c["num_key_value_heads"]
        dim = self.c.get("head_dim") or self.c["hidden_size"] // heads  # Qwen3's may differ (the tiny's does)
        q = (h @ self.t[p + "q_proj.weight"].T).reshape(len(h), heads, dim)
        k = (h @ self.t[p + "k_proj.weight"].T).reshape(len(h), kv, dim)
        if p + "q_norm.weight" in self.t:  # Qwen3: per head, before RoPE
            q, k = self.norm(q, self.t[p + "q_norm.weight"]), self.norm(k, self.t[p + "k_norm.weight"])
        q, k = self.rope(q), self.rope(k)
        v = (h @ self.t[p + "v_proj.weight"].T).reshape(len(h), kv, dim)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)  # repeat_kv
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dim)
        scores = np.where(np.tril(np.ones((len(h), len(h)), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return np.einsum("hqk,khd->qhd", probs, v).reshape(len(h), -1) @ self.t[p + "o_proj.weight"].T

    def mlp(self, h: np.ndarray, p: str, projections: tuple[str, str, str]) -> np.ndarray:
        gate, up, down = (self.t[f"{p}{name}.weight"] for name in projections)
        g = h @ gate.T
        return (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T

    def moe(self, h: np.ndarray, layer: int) -> np.ndarray:
        p = f"model.layers.{layer}.{self.block}."
        logits = h @ self.t[p + "gate.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for row, token_probs in enumerate(probs):
            top = np.argsort(-token_probs)[: self.c["num_experts_per_tok"]]
            weights = token_probs[top] / token_probs[top].sum() if self.renormalise else token_probs[top]
            self.routed |= {(layer, int(e)) for e in top}
            self.took.update(int(e) for e in top)
            for e, w in zip(top, weights, strict=True):
                out[row] += w * self.mlp(h[row : row + 1], f"{p}experts.{e}.", self.projections)[0]
        return out

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits at the last token."""
        x = self.t["model.embed_tokens.weight"][tokens]
        for i in range(self.c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = x + self.attention(self.norm(x, self.t[p + "input_layernorm.weight"]), p + "self_attn.")
            h = self.norm(x, self.t[p + "post_attention_layernorm.weight"])
            dense = ("gate_proj", "up_proj", "down_proj")
            x = x + (self.moe(h, i) if self.is_moe(i) else self.mlp(h, p + "mlp.", dense))
        last = self.norm(x[-1], self.t["model.norm.weight"])
        return last @ self.t.get("lm_head.weight", self.t["model.embed_tokens.weight"]).T


def _matches_the_reference(folder: Path) -> tuple[Reference, list[int]]:
    """The engine's logits equal the reference's on three prompts; the reference and the MoE layers."""
    model, reference = load_model(folder), Reference(folder)
    moe_layers = [i for i in range(len(model.layers)) if reference.is_moe(i)]
    assert moe_layers and [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, Experts)] == moe_layers
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (1, 7, 33)]
    got = model.forward([Chunk(prompt, 0) for prompt in prompts])
    for row, prompt in zip(got, prompts, strict=True):
        want = reference.logits(prompt)
        np.testing.assert_allclose(row, want, atol=ATOL)
        assert int(np.argmax(row)) == int(np.argmax(want))
    return reference, moe_layers


def test_the_engine_matches_the_reference_logits(moe_dir: Path) -> None:
    reference, moe_layers = _matches_the_reference(moe_dir)
    # every expert of every MoE layer took tokens: no path was left untested
    assert reference.routed == {(i, e) for i in moe_layers for e in range(4)}


def test_the_tiny_qwen3_moe_has_heads_wider_than_hidden_over_heads(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """So that the reference test above checks that both read head_dim, not hidden / heads."""
    raw = json.loads((_tiny(tmp_path_factory, "qwen3_moe") / "config.json").read_text())
    assert raw["head_dim"] == 32 != raw["hidden_size"] // raw["num_attention_heads"]


def test_qwen3_moe_without_norm_topk_prob_matches_the_reference(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """``norm_topk_prob`` false: the top-k softmax weights are used as they are, not summing to 1."""
    folder = shutil.copytree(_tiny(tmp_path_factory, "qwen3_moe"), tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"norm_topk_prob": False}))
    reference, _ = _matches_the_reference(folder)
    assert not reference.renormalise


def test_a_mixtral_config_reads_its_experts(mixtral_dir: Path) -> None:
    config = architectures.load_config(mixtral_dir)
    assert config.experts == architectures.Experts(4, 2, 64, renormalise=True, layers=frozenset({0, 1}))
    shapes = config.tensor_shapes()
    assert shapes["model.layers.1.block_sparse_moe.gate.weight"] == (4, 64)
    assert shapes["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == (64, 64)
    assert not any(".mlp." in name for name in shapes)


def test_a_qwen3_moe_config_reads_its_experts_and_dense_layers(tmp_path_factory: pytest.TempPathFactory) -> None:
    raw = json.loads((_tiny(tmp_path_factory, "qwen3_moe") / "config.json").read_text())
    config = architectures.config_from(raw)
    assert config.experts == architectures.Experts(4, 2, 64, renormalise=True, layers=frozenset({1}))
    shapes = config.tensor_shapes()
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (128, 64)  # mlp_only_layers: dense
    assert "model.layers.1.mlp.gate_proj.weight" not in shapes
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 64)
    assert shapes["model.layers.1.self_attn.k_norm.weight"] == (32,)  # the tiny's head_dim, not 64 / 4
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (4 * 32, 64)
    every_other = architectures.config_from(
        raw | {"mlp_only_layers": [], "decoder_sparse_step": 2, "num_hidden_layers": 4}
    )
    assert every_other.experts is not None and every_other.experts.layers == frozenset({1, 3})
    assert not architectures.config_from(raw | {"norm_topk_prob": False}).experts.renormalise  # type: ignore[union-attr]
    with pytest.raises(ModelFilesError, match="bad value"):
        architectures.config_from(raw | {"num_experts_per_tok": 5})
    for bad in ({"num_experts": 100_000}, {"mlp_only_layers": "01"}, {"decoder_sparse_step": 0}):
        with pytest.raises(ModelFilesError, match="bad value"):
            architectures.config_from(raw | bad)
    with pytest.raises(ModelFilesError, match="missing key 'num_experts'"):
        architectures.config_from({k: v for k, v in raw.items() if k != "num_experts"})


def test_partial_outputs_of_disjoint_expert_sets_combine_into_the_whole(moe_dir: Path) -> None:
    """The split expert parallelism will run per rank: each rank's ``run_experts`` over its own
    experts, then ``combine``, equals the MoE MLP of one worker holding them all."""
    model = load_model(moe_dir)
    mlp = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, Experts))
    h = paddle.to_tensor(np.random.default_rng(7).standard_normal((9, 64)).astype(np.float32))
    routing = moe.route(h, mlp.w_router, mlp.per_token, mlp.renormalise)
    assert routing.experts.shape == (9, 2) and len(set(routing.experts.ravel())) > 1
    ranks = [{e: mlp.experts[e] for e in ids} for ids in ((0, 2), (1,), (3,))]
    partials = [moe.run_experts(h, routing, held) for held in ranks]
    assert all(float(paddle.abs(p).sum()) > 0 for p in partials)  # each rank's experts took tokens
    whole = mlp(h, None, np.zeros(mlp.count, dtype=np.int64))
    np.testing.assert_allclose(moe.combine(partials).numpy(), whole.numpy(), atol=1e-6)
    assert not moe.run_experts(h, routing, {}).numpy().any()  # holding none: zero
