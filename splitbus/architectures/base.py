"""What an architecture module declares (``Architecture``) and what it reads a model's
``config.json`` into (``ModelConfig``, the shape the engine builds and the KV cache is sized by).

Plain Python: the API, the GGUF converter and the worker's CLI read it without paddle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from splitbus.tokenization import ModelFilesError

Shapes = dict[str, tuple[int, ...]]
"""Hugging Face tensor name -> its shape, in Hugging Face layout (Linear weights are [out, in])."""


@dataclass(frozen=True)
class Architecture:
    """One model architecture: its names, how its ``config.json`` maps onto a ``ModelConfig``,
    the tensors a checkpoint of it holds, and the forward an engine runs for it. An architecture
    module (one file in this package) makes one and registers it (``splitbus.architectures``).
    A family whose config or tensors differ (MoE) subclasses it and overrides ``model_config``
    and ``tensor_shapes``."""

    hf_name: str
    """Its Hugging Face class, as ``config.json``'s ``architectures`` lists it: the registry's key."""
    model_type: str
    """``config.json``'s ``model_type``: ``ModelConfig.arch``, and what ``make-tiny-model --arch`` takes."""
    gguf_name: str
    """GGUF's ``general.architecture`` for it (llama.cpp's name), which also prefixes its
    metadata keys (``{gguf_name}.block_count``) and picks the gguf package's tensor names."""
    forward: str = "decoder"
    """The forward an engine runs for it: a key of the paddle engine's ``model.FORWARDS``."""
    qkv_bias: bool = False
    """Its q/k/v projections always have biases (Qwen2, whose config has no key that says so);
    False: only when ``config.json``'s ``attention_bias`` is true."""
    gguf_permuted_qk: bool = False
    """llama.cpp's converter permutes its Q and K rows for a RoPE that rotates adjacent pairs
    (Llama); the GGUF reader puts them back, as the engine rotates halves."""
    tiny_ties_embeddings: bool = False
    """The tiny test model (``make-tiny-model``) ties its LM head to the embedding, so that the
    tests load both layouts."""
    qk_norm: bool = False
    """An RMSNorm on each head of q and of k before RoPE (``self_attn.q_norm``/``k_norm``: Qwen3)."""
    gguf_layout: bool = True
    """The GGUF reader and converter know its tensors. False: no GGUF file is read as it, and its
    ``gguf_name`` claims nothing."""

    def model_config(self, raw: dict[str, Any], where: Path | str) -> ModelConfig:
        """``raw`` (a ``config.json`` that names this architecture) as the engine's config;
        ModelFilesError naming ``where`` and the key when a value is missing or wrong."""
        try:
            config = ModelConfig(
                self, **_decoder_dimensions(raw), qkv_bias=self.qkv_bias or _flag(raw, "attention_bias")
            )
        except KeyError as exc:
            raise ModelFilesError(f"{where}: missing key {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ModelFilesError(f"{where}: bad value: {exc}") from None
        if config.heads % config.kv_heads:
            raise ModelFilesError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
        return config

    def tensor_shapes(self, config: ModelConfig) -> Shapes:
        """Every tensor the engine loads for a model of this architecture: a decoder's."""
        return decoder_shapes(config)

    def tiny_keys(self, hidden: int) -> dict[str, Any]:
        """The ``config.json`` keys a tiny model of it needs beyond a decoder's: none."""
        return {}


MAX_LAYERS = 1024
"""The most decoder layers a model may declare, in a ``config.json`` or a GGUF file's
``{arch}.block_count`` (the largest open checkpoints have under 200): a config.json is untrusted,
and a huge count would list millions of tensors before any check against the weights."""

MAX_EXPERTS = 1024
"""The most experts per layer a ``config.json`` may declare (DeepSeek-V3 and Qwen3-MoE have 256 and 128)."""


@dataclass(frozen=True)
class Experts:
    """The experts of a mixture-of-experts model's MoE layers (the same in each)."""

    count: int
    """Experts per MoE layer."""
    per_token: int
    """Experts each token is routed to (the top-k of the router's softmax)."""
    intermediate_size: int
    """Each expert's gated MLP width."""
    renormalise: bool
    """The top-k routing weights are divided by their sum (Mixtral always; Qwen3-MoE by ``norm_topk_prob``)."""
    layers: frozenset[int]
    """The layers whose MLP is a mixture of experts; the others keep a dense one."""

    def __post_init__(self) -> None:
        # A config.json is untrusted: a huge count would list millions of tensors before any check.
        if not 1 <= self.per_token <= self.count <= MAX_EXPERTS or self.intermediate_size < 1:
            raise ValueError(f"{self.per_token} experts per token of {self.count}, width {self.intermediate_size}")


@dataclass(frozen=True)
class ModelConfig:
    """A model's dimensions as the engine builds it, read from its ``config.json`` once."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    experts: Experts | None = None
    """Its MoE layers' experts; None: a dense model."""

    @property
    def arch(self) -> str:
        """Its architecture's ``model_type`` ("llama"), as logs name it."""
        return self.architecture.model_type

    def tensor_shapes(self) -> Shapes:
        """Every tensor a checkpoint of this model holds, as its architecture lays them out."""
        return self.architecture.tensor_shapes(self)


def _decoder_dimensions(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields of a decoder's ``ModelConfig`` from the Hugging Face keys, with their defaults."""
    heads, hidden = _size(raw, "num_attention_heads"), _size(raw, "hidden_size")
    return {
        "vocab_size": _size(raw, "vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": _size(raw, "intermediate_size"),
        "layers": _size(raw, "num_hidden_layers", MAX_LAYERS),
        "heads": heads,
        "kv_heads": _size(raw, "num_key_value_heads", default=heads),
        "head_dim": _size(raw, "head_dim", default=hidden // heads),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(raw),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": _flag(raw, "tie_word_embeddings"),
    }


def _size(raw: dict[str, Any], key: str, high: int | None = None, default: int | None = None) -> int:
    """``raw[key]`` as a count in [1, ``high``] (unbounded above when None); ``default`` when
    absent or null (a KeyError when there is none). ValueError naming the key when out of range."""
    size = int(raw[key] if default is None else raw.get(key) or default)
    if size < 1 or (high is not None and size > high):
        raise ValueError(f"{key} = {size} is outside [1, {high or 'inf'}]")
    return size


def _flag(raw: dict[str, Any], key: str) -> bool:
    return bool(raw.get(key, False))


def _rope_theta(raw: dict[str, Any]) -> float:
    """Newer transformers configs keep it under rope_parameters."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(raw.get("rope_theta", 10000.0))


def decoder_shapes(c: ModelConfig) -> Shapes:
    """A Llama-style decoder's tensors: embedding, final norm, LM head unless tied, and per layer
    attention (q/k/v biases when ``qkv_bias``), a gated MLP and two norms."""
    shapes: Shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.layers):
        shapes |= _layer_shapes(c, f"model.layers.{i}.")
    return shapes


def _layer_shapes(c: ModelConfig, p: str) -> Shapes:
    q, kv, hidden, inter = c.heads * c.head_dim, c.kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    shapes: Shapes = {
        p + "self_attn.q_proj.weight": (q, hidden),
        p + "self_attn.k_proj.weight": (kv, hidden),
        p + "self_attn.v_proj.weight": (kv, hidden),
        p + "self_attn.o_proj.weight": (hidden, q),
        p + "mlp.gate_proj.weight": (inter, hidden),
        p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
    }
    if c.architecture.qk_norm:
        shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
    if c.qkv_bias:
        shapes |= {
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.bias": (kv,),
        }
    return shapes


_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def _moe_layers(raw: dict[str, Any], layers: int) -> frozenset[int]:
    """Hugging Face's rule: a layer is MoE unless ``mlp_only_layers`` lists it, every
    ``decoder_sparse_step``-th (1: all)."""
    listed = raw.get("mlp_only_layers") or []
    if not isinstance(listed, list):
        raise TypeError(f"mlp_only_layers must be a list, got {listed!r}")
    step, dense = int(raw.get("decoder_sparse_step", 1)), {int(i) for i in listed}
    if step < 1:
        raise ValueError(f"decoder_sparse_step {step}")
    return frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


@dataclass(frozen=True)
class MixtureOfExperts(Architecture):
    """A decoder whose every layer's MLP is a mixture of gated-MLP experts: a router (a Linear
    ``[experts, hidden]``) picks each token's top-k experts by softmax, and their outputs are
    summed weighted by it. The fields say where its ``config.json`` and tensors keep each part."""

    forward: str = "decoder"
    count_key: str = "num_local_experts"
    """``config.json``'s key for experts per layer."""
    width_key: str = "intermediate_size"
    """``config.json``'s key for each expert's MLP width."""
    renormalise_key: str | None = None
    """``config.json``'s key that says whether top-k weights are renormalised; None: always."""
    block: str = "block_sparse_moe"
    """A layer's MoE block, under ``model.layers.N.``: its router is ``{block}.gate``, its
    experts ``{block}.experts.E.``."""
    projections: tuple[str, str, str] = ("w1", "w3", "w2")
    """An expert's gate, up and down projections."""
    tiny_dense_layers: tuple[int, ...] = ()
    """The tiny model's ``mlp_only_layers``: dense layers among MoE ones, for the tests."""
    tiny_wide_heads: bool = False
    """The tiny model's ``head_dim`` is hidden / 2, not hidden / heads (Qwen3-MoE-30B-A3B: 128, not
    2048 / 32), so that the tests run attention wider than the residual stream."""

    def model_config(self, raw: dict[str, Any], where: Path | str) -> ModelConfig:
        """A decoder's config and its experts'."""
        # Only dense layers (mlp_only_layers) use intermediate_size: a config without them may omit it.
        config = super().model_config(raw | {"intermediate_size": raw.get("intermediate_size", 1)}, where)
        try:
            experts = self._experts(raw, config.layers)
        except KeyError as exc:
            raise ModelFilesError(f"{where}: missing key {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ModelFilesError(f"{where}: bad value: {exc}") from None
        return replace(config, experts=experts)

    def _experts(self, raw: dict[str, Any], layers: int) -> Experts:
        renormalise = True if self.renormalise_key is None else _flag(raw, self.renormalise_key)
        count, per_token, width = int(raw[self.count_key]), int(raw["num_experts_per_tok"]), int(raw[self.width_key])
        if not 1 <= per_token <= count <= MAX_EXPERTS or width < 1:
            raise ValueError(
                f"need 1 <= num_experts_per_tok ({per_token}) <= {self.count_key} ({count}) <= {MAX_EXPERTS} "
                f"and {self.width_key} ({width}) >= 1"
            )
        return Experts(count, per_token, width, renormalise, _moe_layers(raw, layers))

    def tensor_shapes(self, config: ModelConfig) -> Shapes:
        """A decoder's tensors with each layer's dense MLP replaced by a router and experts."""
        experts = config.experts
        assert experts is not None  # model_config set it
        shapes = decoder_shapes(config)
        hidden, width = config.hidden_size, experts.intermediate_size
        for i in sorted(experts.layers):
            for name in _DENSE_MLP:
                del shapes[f"model.layers.{i}.{name}"]
            shapes[self.router(i)] = (experts.count, hidden)
            for e in range(experts.count):
                gate, up, down = self.expert(i, e)
                shapes |= {gate: (width, hidden), up: (width, hidden), down: (hidden, width)}
        return shapes

    def router(self, layer: int) -> str:
        """The router's tensor name in layer ``layer``."""
        return f"model.layers.{layer}.{self.block}.gate.weight"

    def expert(self, layer: int, expert: int) -> tuple[str, str, str]:
        """The gate, up and down projections' tensor names of one expert of one layer."""
        return self._projections(f"model.layers.{layer}.{self.block}.experts.{expert}.")

    def stacked(self, layer: int) -> tuple[str, str, str]:
        """The gate, up and down projections of every expert of layer ``layer`` stacked in one
        tensor each (``[experts, out, in]``), named as llama.cpp's converter names them before it
        maps them to GGUF's ``ffn_{gate,up,down}_exps``: the gguf package's ``TensorNameMap`` key."""
        return self._projections(f"model.layers.{layer}.{self.block}.experts.")

    def _projections(self, prefix: str) -> tuple[str, str, str]:
        return tuple(f"{prefix}{name}.weight" for name in self.projections)  # type: ignore[return-value]

    def gguf_keys(self, experts: Experts) -> dict[str, Any]:
        """The ``config.json`` keys of the experts a GGUF file declares. llama.cpp's MoE layouts
        have experts in every layer: no ``mlp_only_layers`` nor ``decoder_sparse_step``, whose
        absence means that."""
        keys: dict[str, Any] = {
            self.count_key: experts.count,
            "num_experts_per_tok": experts.per_token,
            self.width_key: experts.intermediate_size,
        }
        if self.renormalise_key is not None:
            keys[self.renormalise_key] = experts.renormalise
        return keys

    def tiny_keys(self, hidden: int) -> dict[str, Any]:
        """Four experts of width ``hidden``, two per token (and its dense layers)."""
        keys: dict[str, Any] = {self.count_key: 4, "num_experts_per_tok": 2, self.width_key: hidden}
        if self.renormalise_key is not None:
            keys[self.renormalise_key] = True
        if self.tiny_dense_layers:
            keys["mlp_only_layers"] = list(self.tiny_dense_layers)
        if self.tiny_wide_heads:
            keys["head_dim"] = hidden // 2
        return keys
