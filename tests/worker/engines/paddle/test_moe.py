"""Mixtral in the paddle engine against an independent numpy reference.

The reference is written here from the equations of Hugging Face transformers' Mixtral modeling
code (``modeling_mixtral.py``), not from the engine: RMSNorm ``x / sqrt(mean(x^2) + eps) * w``;
rotate-half RoPE; grouped-query causal attention with scores scaled by ``1/sqrt(head_dim)``; per
layer ``x += attn(norm1(x))`` then ``x += moe(norm2(x))``, where the MoE block takes the softmax
of the router logits over every expert, keeps the top ``num_experts_per_tok``, divides those by
their sum, and adds each chosen expert's ``w2(silu(w1 h) * w3 h)`` times its weight; the LM head
after the final norm. Float64 throughout, from the checkpoint's own safetensors file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from splitbus import architectures
from splitbus.worker.engines.paddle.model import Chunk, Experts, load_model
from splitbus.worker.engines.paddle.tiny import make_tiny_model

ATOL = 1e-4  # as the engine's paged-vs-contiguous logits test compares


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mixtral") / "m", "mixtral", seed=4, hidden=64, layers=2)


class Reference:
    """Mixtral's forward in numpy (float64), position by position of one sequence."""

    def __init__(self, folder: Path) -> None:
        self.c = json.loads((folder / "config.json").read_text())
        self.t = {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
        self.routed: set[int] = set()

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
        dim = self.c["hidden_size"] // heads
        q = self.rope((h @ self.t[p + "q_proj.weight"].T).reshape(len(h), heads, dim))
        k = self.rope((h @ self.t[p + "k_proj.weight"].T).reshape(len(h), kv, dim))
        v = (h @ self.t[p + "v_proj.weight"].T).reshape(len(h), kv, dim)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)  # repeat_kv
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dim)
        scores = np.where(np.tril(np.ones((len(h), len(h)), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return np.einsum("hqk,khd->qhd", probs, v).reshape(len(h), -1) @ self.t[p + "o_proj.weight"].T

    def moe(self, h: np.ndarray, p: str) -> np.ndarray:
        logits = h @ self.t[p + "gate.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for row, token_probs in enumerate(probs):
            top = np.argsort(-token_probs)[: self.c["num_experts_per_tok"]]
            weights = token_probs[top] / token_probs[top].sum()
            self.routed |= {int(e) for e in top}
            for e, w in zip(top, weights, strict=True):
                x = h[row]
                gate, up = self.t[f"{p}experts.{e}.w1.weight"] @ x, self.t[f"{p}experts.{e}.w3.weight"] @ x
                out[row] += w * (self.t[f"{p}experts.{e}.w2.weight"] @ (gate / (1 + np.exp(-gate)) * up))
        return out

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits at the last token."""
        x = self.t["model.embed_tokens.weight"][tokens]
        for i in range(self.c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = x + self.attention(self.norm(x, self.t[p + "input_layernorm.weight"]), p + "self_attn.")
            x = x + self.moe(self.norm(x, self.t[p + "post_attention_layernorm.weight"]), p + "block_sparse_moe.")
        last = self.norm(x[-1], self.t["model.norm.weight"])
        return last @ self.t.get("lm_head.weight", self.t["model.embed_tokens.weight"]).T


def test_the_engine_matches_the_reference_logits(mixtral_dir: Path) -> None:
    model, reference = load_model(mixtral_dir), Reference(mixtral_dir)
    assert all(isinstance(layer.mlp, Experts) for layer in model.layers)
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (1, 7, 33)]
    got = model.forward([Chunk(prompt, 0) for prompt in prompts])
    for row, prompt in zip(got, prompts, strict=True):
        want = reference.logits(prompt)
        np.testing.assert_allclose(row, want, atol=ATOL)
        assert int(np.argmax(row)) == int(np.argmax(want))
    assert reference.routed == set(range(4))  # every expert took tokens: no path was left untested


def test_a_mixtral_config_reads_its_experts(mixtral_dir: Path) -> None:
    config = architectures.load_config(mixtral_dir)
    assert config.experts == architectures.Experts(count=4, per_token=2, intermediate_size=64, renormalise=True)
    shapes = config.tensor_shapes()
    assert shapes["model.layers.1.block_sparse_moe.gate.weight"] == (4, 64)
    assert shapes["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == (64, 64)
    assert not any(".mlp." in name for name in shapes)
