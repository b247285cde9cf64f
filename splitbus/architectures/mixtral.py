"""Mixtral (``MixtralForCausalLM``): Llama's decoder with a mixture of experts in every layer
(``block_sparse_moe``: router ``gate``, experts ``w1``/``w3``/``w2``), top-k weights always
renormalised. llama.cpp writes it as ``llama`` with stacked expert tensors, which the GGUF reader
does not read yet."""

from __future__ import annotations

from splitbus.architectures import register
from splitbus.architectures.base import MixtureOfExperts

MIXTRAL = register(MixtureOfExperts("MixtralForCausalLM", model_type="mixtral", gguf_name="llama"))
