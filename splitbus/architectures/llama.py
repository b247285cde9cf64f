"""Llama (``LlamaForCausalLM``): the decoder the others vary; q/k/v biases only when
``attention_bias`` says so."""

from __future__ import annotations

from splitbus.architectures import register
from splitbus.architectures.base import Architecture

LLAMA = register(Architecture("LlamaForCausalLM", model_type="llama", gguf_name="llama", gguf_permuted_qk=True))
