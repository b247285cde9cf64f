"""Mixtral (``MixtralForCausalLM``): Llama's decoder with a mixture of experts in every layer
(``block_sparse_moe``: router ``gate``, experts ``w1``/``w3``/``w2``), top-k weights always
renormalised. llama.cpp writes it as ``llama`` with ``llama.expert_count`` > 0 and each layer's
experts stacked (``ffn_{gate,up,down}_exps``), its Q and K rows permuted as Llama's."""

from __future__ import annotations

from splitbus.architectures import register
from splitbus.architectures.base import MixtureOfExperts

MIXTRAL = register(
    MixtureOfExperts("MixtralForCausalLM", model_type="mixtral", gguf_name="llama", gguf_permuted_qk=True)
)
