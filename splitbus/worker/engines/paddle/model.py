"""The decoder forward (Llama, Qwen2, and the mixtures of experts Mixtral and Qwen3-MoE) on gpu_ops: one
forward pass for any mix of prefill and decode chunks. ``FORWARDS`` names it for the
architectures (``Architecture.forward``).

Every chunk is a run of tokens of one sequence starting at an absolute position. Linear layers
run on all chunks' tokens at once, and so does attention (``batched_attention``): over the paged
cache, or with no cache over each chunk itself (the full-recompute reference). What a step needs
on the device (token ids, positions, cache slots, the attention's rows and masks) is made once per
step, never per layer; RoPE's tables are made at load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F

from splitbus.architectures import ModelConfig, load_config
from splitbus.architectures.base import MixtureOfExperts
from splitbus.bus.messages import Logprobs
from splitbus.gpu_ops.attention import Run, plan
from splitbus.gpu_ops.expert_parallel import ExpertGroup, expert_shard
from splitbus.gpu_ops.kernels import Kernels, chosen
from splitbus.gpu_ops.kv_cache import KVDtype, PagedKVCache
from splitbus.gpu_ops.layers import RopeTables, silu_and_mul
from splitbus.gpu_ops.moe import Expert, combine, gated_mlp, route, run_experts, tally
from splitbus.gpu_ops.sampling import on_host
from splitbus.worker.engines.paddle import logprobs, weights
from splitbus.worker.engines.paddle.dtypes import KV_DTYPE
from splitbus.worker.engines.paddle.logprobs import PROMPT_ROWS

ROPE_AT_LOAD = 8192
"""Positions whose RoPE rows are made at load (more are made when a longer sequence comes)."""


@dataclass(frozen=True)
class Chunk:
    tokens: list[int]
    start: int
    """Absolute position of ``tokens[0]``; positions before it are in the cache."""
    table: list[int] | None = None
    """The sequence's block table; None: no cache, ``tokens`` is the whole sequence."""


@dataclass
class Layer:
    ln1: paddle.Tensor
    w_qkv: paddle.Tensor  # [hidden, (heads + 2 kv_heads) * head_dim]: q, k, v fused
    b_qkv: paddle.Tensor | None
    w_o: paddle.Tensor
    ln2: paddle.Tensor
    qk_norm: tuple[paddle.Tensor, paddle.Tensor] | None  # RMSNorm weights of each q and k head (Qwen3)
    mlp: Expert | Experts  # a dense gated MLP (in the shape of one expert), or a mixture of experts


@dataclass(frozen=True)
class Experts:
    """A layer's mixture of experts: its router and the experts this worker holds (every one, or
    its rank's share under expert parallelism)."""

    w_router: paddle.Tensor  # [hidden, experts]
    experts: dict[int, Expert]
    count: int
    """Experts in the layer, held here or not."""
    per_token: int
    renormalise: bool

    def __call__(
        self,
        h: paddle.Tensor,
        group: ExpertGroup | None,
        counts: np.ndarray,
        counted: bool = True,
        swiglu: Callable[[paddle.Tensor], paddle.Tensor] = silu_and_mul,
    ) -> paddle.Tensor:
        """The MoE MLP of this rank's tokens ``h``; with a ``group``, its tokens and the other
        ranks' go to the ranks holding their experts and come back (``ExpertGroup``). Adds to
        ``counts`` the tokens each expert took (not an idle forward's: ``counted``, the group's)."""
        routing = route(h, self.w_router, self.per_token, self.renormalise)
        if group is None:
            if counted:
                tally(routing, counts)
            return combine([run_experts(h, routing, self.experts, swiglu)])
        every, routed = group.dispatch(h, routing, self.count)
        tally(routed, counts, group.counted)
        return combine([group.combine(run_experts(every, routed, self.experts, swiglu))])


def _t(array: np.ndarray, dtype: KVDtype = KV_DTYPE) -> paddle.Tensor:
    tensor = paddle.to_tensor(np.ascontiguousarray(array, dtype=np.float32))
    return tensor if dtype == KV_DTYPE else tensor.astype(dtype)


def _expert(t: dict[str, np.ndarray], names: tuple[str, str, str], dtype: KVDtype) -> Expert:
    """A gated MLP from its gate, up and down projections (HF [out, in]), gate and up fused."""
    gate, up, down = (t[name] for name in names)
    return Expert(w_gate_up=_t(np.concatenate([gate, up], axis=0).T, dtype), w_down=_t(down.T, dtype))


class CausalLM:
    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, np.ndarray],
        shard: tuple[int, int] = (0, 1),
        dtype: KVDtype = KV_DTYPE,
        kernels: str = "auto",
    ) -> None:
        """``shard``: (rank, ranks) of an expert-parallel group: the model holds that rank's share
        of each MoE layer's experts (``expert_shard``); (0, 1) holds them all. ``kernels``: the
        name of the ops its layers call (``splitbus.gpu_ops.kernels.KERNELS``). ``dtype``: of its
        weights and KV cache (``dtypes.compute_dtype``)."""
        self.config = config
        self.dtype = dtype
        count = config.experts.count if config.experts is not None else 0
        self.held = expert_shard(count, *shard) if count else range(0)
        """The experts of each MoE layer this model holds."""
        self.expert_tokens = np.zeros(count, dtype=np.int64)
        """Tokens each expert took in the last forward (every MoE layer's, added; the group's
        tokens under expert parallelism, of which this rank's experts took those in ``held``)."""
        self.group: ExpertGroup | None = None
        """The expert-parallel group, once formed (``ExpertGroup.form``); None: every expert is here."""
        self.prompt_logprobs: dict[int, Logprobs] = {}
        """The last forward's prompt logprobs, by chunk index (its ``prompt_top``)."""
        self.embed = _t(tensors["model.embed_tokens.weight"], dtype)
        self.norm = _t(tensors["model.norm.weight"], dtype)
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])  # tied: reuse the embedding
        self.lm_head = _t(head.T, dtype)  # HF Linear is [out, in]; matmul wants [in, out]
        self.layers = [self._layer(tensors, i) for i in range(config.layers)]
        self.kernels: Kernels = chosen(kernels, dtype)
        """The ops its layers call: Paddle's fused kernels where the device has them (``KERNELS``)."""
        length = min(config.max_position_embeddings, ROPE_AT_LOAD)
        self.rope = RopeTables(config.head_dim, config.rope_theta, length, dtype)

    def _layer(self, t: dict[str, np.ndarray], i: int) -> Layer:
        p = f"model.layers.{i}."
        qkv = np.concatenate([t[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], axis=0).T
        bias = np.concatenate([t[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]) if self.config.qkv_bias else None
        return Layer(
            ln1=_t(t[p + "input_layernorm.weight"], self.dtype),
            w_qkv=_t(qkv, self.dtype),
            b_qkv=_t(bias, self.dtype) if bias is not None else None,
            w_o=_t(t[p + "self_attn.o_proj.weight"].T, self.dtype),
            ln2=_t(t[p + "post_attention_layernorm.weight"], self.dtype),
            qk_norm=(_t(t[p + "self_attn.q_norm.weight"], self.dtype), _t(t[p + "self_attn.k_norm.weight"], self.dtype))
            if self.config.architecture.qk_norm
            else None,
            mlp=self._mlp(t, i),
        )

    def _mlp(self, t: dict[str, np.ndarray], i: int) -> Expert | Experts:
        arch, experts = self.config.architecture, self.config.experts
        if experts is None or i not in experts.layers or not isinstance(arch, MixtureOfExperts):
            p = f"model.layers.{i}.mlp."
            return _expert(t, (p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"), self.dtype)
        held = {e: _expert(t, arch.expert(i, e), self.dtype) for e in self.held}
        return Experts(_t(t[arch.router(i)].T, self.dtype), held, experts.count, experts.per_token, experts.renormalise)

    def weight_bytes(self) -> tuple[int, int]:
        """Bytes of the weights held: (everything but the experts, the experts)."""
        experts = sum(
            _bytes(e.w_gate_up) + _bytes(e.w_down)
            for layer in self.layers
            if isinstance(layer.mlp, Experts)
            for e in layer.mlp.experts.values()
        )
        every = [self.embed, self.norm, self.lm_head, *(t for layer in self.layers for t in _tensors(layer))]
        return sum(map(_bytes, every)) - experts, experts

    def new_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """A KV cache in the model's dtype."""
        c = self.config
        return PagedKVCache(c.layers, num_blocks, block_size, c.kv_heads, c.head_dim, dtype=self.dtype)

    def forward(
        self,
        chunks: list[Chunk],
        cache: PagedKVCache | None = None,
        counted: bool = True,
        prompt_top: Mapping[int, int] | None = None,
    ) -> np.ndarray:
        """``run``'s logits, on the host, in float32 (``on_host``)."""
        return on_host(self.run(chunks, cache, counted, prompt_top))

    @paddle.no_grad()
    def run(
        self,
        chunks: list[Chunk],
        cache: PagedKVCache | None = None,
        counted: bool = True,
        prompt_top: Mapping[int, int] | None = None,
    ) -> paddle.Tensor:
        """Logits ``[len(chunks), vocab]`` at the last token of each chunk, on the device; writes
        the chunks' K/V into ``cache`` at their positions. ``counted``: its tokens count in the
        experts' loads (``expert_tokens``; not an idle forward's). ``prompt_top``: chunk index -> k,
        the chunks whose every token's logprob (after the first) is wanted too, with the top k of
        each position: left in ``prompt_logprobs`` by chunk index."""
        tokens = np.concatenate([np.asarray(ch.tokens, dtype=np.int64) for ch in chunks])
        positions = np.concatenate([np.arange(ch.start, ch.start + len(ch.tokens)) for ch in chunks])
        ends = np.cumsum([len(ch.tokens) for ch in chunks])
        plan = _Plan(chunks, ends, cache, self.config.heads, self.kernels.unpadded, self.dtype)
        cos, sin = self.rope.at(paddle.to_tensor(positions), int(positions.max()))
        x = F.embedding(paddle.to_tensor(tokens), self.embed)
        self.expert_tokens[:] = 0
        if self.group is not None:
            self.group.begin(len(tokens), counted)
        for index, layer in enumerate(self.layers):
            x = x + self._attend(layer, index, x, cos, sin, plan)
            h = self.kernels.rms_norm(x, layer.ln2, self.config.rms_norm_eps)
            if isinstance(layer.mlp, Experts):
                x = x + layer.mlp(h, self.group, self.expert_tokens, counted, self.kernels.swiglu)
            else:
                x = x + gated_mlp(h, layer.mlp, self.kernels.swiglu)
        self.prompt_logprobs = {j: self._scores(x, plan.spans[j], k) for j, k in (prompt_top or {}).items()}
        last = paddle.index_select(x, paddle.to_tensor(ends - 1), axis=0)
        # The LM head only for the last position of each chunk: vocabularies reach 150k.
        return self._logits(last)

    def _logits(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(self.kernels.rms_norm(x, self.norm, self.config.rms_norm_eps), self.lm_head)

    def _scores(self, x: paddle.Tensor, span: tuple[Chunk, int, int], k: int) -> Logprobs:
        """The logprobs of a chunk's tokens after its first, each from the position before it,
        the LM head run over ``PROMPT_ROWS`` positions at a time."""
        chunk, a, b = span
        targets = np.asarray(chunk.tokens[1:], dtype=np.int64)
        parts = [
            logprobs.of_rows(
                on_host(self._logits(x[row : min(row + PROMPT_ROWS, b - 1)])), targets[row - a :][:PROMPT_ROWS], k
            )
            for row in range(a, b - 1, PROMPT_ROWS)
        ]
        return sum(parts[1:], parts[0]) if parts else Logprobs([], [], [])

    def _attend(
        self, layer: Layer, index: int, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, plan: _Plan
    ) -> paddle.Tensor:
        c = self.config
        ops = self.kernels
        h = ops.rms_norm(x, layer.ln1, c.rms_norm_eps)
        qkv = paddle.matmul(h, layer.w_qkv)
        if layer.b_qkv is not None:
            qkv = qkv + layer.b_qkv
        q, k, v = paddle.split(qkv, [c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], axis=-1)
        q, k = q.reshape([-1, c.heads, c.head_dim]), k.reshape([-1, c.kv_heads, c.head_dim])
        if layer.qk_norm is not None:
            q, k = ops.rms_norm(q, layer.qk_norm[0], c.rms_norm_eps), ops.rms_norm(k, layer.qk_norm[1], c.rms_norm_eps)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        v = v.reshape([-1, c.kv_heads, c.head_dim])
        return paddle.matmul(ops.attention(q, *plan.sources(index, k, v), plan.attention), layer.w_o)


FORWARDS: dict[str, type[CausalLM]] = {"decoder": CausalLM}
"""An architecture's ``forward`` -> the model that runs it here."""


def load_model(
    folder: Path, shard: tuple[int, int] = (0, 1), dtype: KVDtype = KV_DTYPE, kernels: str = "auto"
) -> CausalLM:
    """The model of a Hugging Face folder, run by the forward its architecture names; ``shard``:
    (rank, ranks) of an expert-parallel group, whose share of the experts it holds; ``dtype``: its
    weights' and KV cache's; ``kernels``: ``splitbus.gpu_ops.kernels.KERNELS``'s name."""
    config = load_config(folder)
    forward = FORWARDS.get(config.architecture.forward)
    if forward is None:
        raise ValueError(
            f"the paddle engine has no forward {config.architecture.forward!r} for {config.architecture.hf_name}"
        )
    tensors = dict(weights.load(folder, config, _other_ranks_experts(config, shard)))
    return forward(config, tensors, shard, dtype, kernels)


def _other_ranks_experts(config: ModelConfig, shard: tuple[int, int]) -> set[str]:
    """The tensor names of the experts that ``shard``'s rank does not hold: never read."""
    arch, experts = config.architecture, config.experts
    if experts is None or not isinstance(arch, MixtureOfExperts):
        return set()
    held = expert_shard(experts.count, *shard)
    return {name for i in experts.layers for e in range(experts.count) if e not in held for name in arch.expert(i, e)}


class _Plan:
    """A forward pass's layout, made once on the host and uploaded as a few device tensors that
    every layer reads: where the chunks' new K/V go in the cache, and the attention's rows and masks."""

    def __init__(
        self,
        chunks: list[Chunk],
        ends: np.ndarray,
        cache: PagedKVCache | None,
        heads: int,
        unpadded: bool,
        dtype: KVDtype,
    ) -> None:
        starts = np.concatenate([[0], ends[:-1]]).astype(int)
        self.spans = [(ch, int(a), int(b)) for ch, a, b in zip(chunks, starts, ends, strict=True)]
        self.cache = cache
        total = int(ends[-1])
        if cache is None:  # no cache: each chunk is a whole sequence, attending to its own keys
            if any(ch.start for ch in chunks):
                raise ValueError("a forward without a cache takes whole sequences: every chunk starts at 0")
            runs = [Run(a, 0, b - a, np.arange(a, b)) for _, a, b in self.spans]
            self.attention = plan(runs, heads, total, total, unpadded, dtype)
            return
        slots = [cache.slots(ch.table or [], 0, ch.start + len(ch.tokens)) for ch in chunks]
        self.new_slots = paddle.to_tensor(np.concatenate([s[ch.start :] for s, ch in zip(slots, chunks, strict=True)]))
        runs = [Run(a, ch.start, b - a, s) for (ch, a, b), s in zip(self.spans, slots, strict=True)]
        # Padding reads slot 0, in the scratch block, which holds only the finite K/V an idle
        # forward writes (PaddleEngine.idle): masked to a weight of ~1e-28, never to inf * 0.
        self.attention = plan(runs, heads, 0, total, unpadded, dtype)

    def sources(self, layer: int, k: paddle.Tensor, v: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """The rows the layer's queries attend to: the cache's pools (the step's K/V written in
        them), or with no cache the step's own K/V and a zero row to pad with."""
        if self.cache is not None:
            self.cache.write(layer, self.new_slots, k, v)
            return self.cache.k[layer], self.cache.v[layer]
        zero = paddle.zeros([1, *k.shape[1:]], k.dtype)
        return paddle.concat([k, zero]), paddle.concat([v, zero])


def _bytes(t: paddle.Tensor) -> int:
    return int(np.prod(t.shape)) * t.element_size()


def _tensors(layer: Layer) -> list[paddle.Tensor]:
    """Every tensor a layer holds (a dense MLP's, a router and the experts held)."""
    mlp = [layer.mlp.w_gate_up, layer.mlp.w_down] if isinstance(layer.mlp, Expert) else [layer.mlp.w_router]
    if isinstance(layer.mlp, Experts):
        mlp += [w for e in layer.mlp.experts.values() for w in (e.w_gate_up, e.w_down)]
    norms = [*(layer.qk_norm or ()), layer.ln1, layer.ln2]
    return [layer.w_qkv, layer.w_o, *norms, *mlp, *([layer.b_qkv] if layer.b_qkv is not None else [])]
