"""Qwen3-MoE (``Qwen3MoeForCausalLM``): a decoder with RMSNorm on each q and k head, whose MLP is
a mixture of experts (``mlp.gate``, ``mlp.experts.E.{gate,up,down}_proj``) in every
``decoder_sparse_step``-th layer not in ``mlp_only_layers``; top-k weights renormalised when
``norm_topk_prob``. llama.cpp's ``qwen3moe`` files stack each layer's experts
(``ffn_{gate,up,down}_exps``) and have experts in every layer; their Q and K rows are not permuted
(llama.cpp runs it with NeoX RoPE, halves)."""

from __future__ import annotations

from splitbus.architectures import register
from splitbus.architectures.base import MixtureOfExperts

QWEN3_MOE = register(
    MixtureOfExperts(
        "Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        gguf_name="qwen3moe",
        qk_norm=True,
        count_key="num_experts",
        width_key="moe_intermediate_size",
        renormalise_key="norm_topk_prob",
        block="mlp",
        projections=("gate_proj", "up_proj", "down_proj"),
        tiny_dense_layers=(0,),
        tiny_wide_heads=True,
    )
)
