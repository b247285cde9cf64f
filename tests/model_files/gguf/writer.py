"""Tests' GGUF writer: a Hugging Face folder (float32, as ``make_tiny_model`` writes it) -> a GGUF
file laid out as llama.cpp's convert_hf_to_gguf.py lays one out.

- metadata: ``general.architecture`` and the ``{arch}.*`` hyperparameters the converter writes;
  the vocabulary through ``tests/model_files/gguf/vocab_writer.add_vocab`` when it is there;
- names: the gguf package's ``TensorNameMap`` (Hugging Face -> GGUF), under the architecture's
  GGUF name (Mixtral: ``llama``, Qwen3-MoE: ``qwen3moe``);
- Llama's and Mixtral's Q and K rows permuted for llama.cpp's adjacent-pair RoPE
  (``LlamaModel.permute``); Qwen2's and Qwen3-MoE's are not;
- a MoE model's experts stacked per layer and projection, ``[experts, out, in]`` in numpy's
  order, as ``ffn_{gate,up,down}_exps``, with ``{arch}.expert_count``, ``expert_used_count`` and
  (Qwen3-MoE, whose expert width has its own key) ``expert_feed_forward_length``;
- types: 1-D tensors (norms, biases) stay F32, as llama.cpp keeps them; 2-D and 3-D (stacked
  experts) ones take ``qtype`` (F32, F16, or a type ``gguf.quants.quantize`` can write: Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1, BF16; the package cannot write K-quants or IQ types, only read them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, TensorNameMap
from gguf.quants import quantize
from safetensors.numpy import load_file

from splitbus import architectures
from splitbus.architectures import MixtureOfExperts

try:  # the vocabulary half of the writer lives beside this one once its part is merged
    from tests.model_files.gguf.vocab_writer import add_vocab
except ImportError:  # pragma: no cover - before the vocab part is merged
    add_vocab = None


def write_gguf(
    hf_folder: Path,
    out: Path,
    qtype: str = "F32",
    *,
    arch: str | None = None,
    tensor_types: dict[str, str] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    drop: frozenset[str] = frozenset(),
    hparams: dict[str, Any] | None = None,
    vocab: bool = True,
    metadata: Callable[[GGUFWriter], None] | None = None,
) -> Path:
    """Write ``out``; ``arch`` overrides ``general.architecture`` (for a wrong-architecture file),
    ``tensor_types`` a GGUF tensor's type ("I8" writes it as int8, a type nothing dequantizes),
    ``extra_tensors`` adds tensors under GGUF names, ``drop`` leaves GGUF tensors out, ``hparams``
    replaces config.json values in the metadata only (a file whose metadata lies), ``metadata``
    adds keys of its own (called with the writer after the vocabulary)."""
    config = json.loads((hf_folder / "config.json").read_text())
    writer = GGUFWriter(out, arch or architectures.of_config(config).gguf_name)
    _add_hparams(writer, config | (hparams or {}))
    if vocab and add_vocab is not None:
        add_vocab(writer, hf_folder)
    if metadata is not None:
        metadata(writer)
    for name, array in _gguf_tensors(hf_folder, config):
        if name in drop:
            continue
        kind = (tensor_types or {}).get(name, qtype if array.ndim >= 2 else "F32")
        _add(writer, name, array, kind)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_hparams(writer: GGUFWriter, c: dict[str, Any]) -> None:
    # GGUFWriter formats its keys with its own arch; these are the calls convert_hf_to_gguf.py makes.
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_vocab_size(c["vocab_size"])
    writer.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    if c.get("head_dim"):  # a head wider than hidden / heads (Qwen3-MoE), as the converter writes it
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    arch = architectures.of_config(c)
    if isinstance(arch, MixtureOfExperts):
        writer.add_expert_count(c[arch.count_key])
        writer.add_expert_used_count(c["num_experts_per_tok"])
        if arch.width_key != "intermediate_size":
            writer.add_expert_feed_forward_length(c[arch.width_key])


def _gguf_tensors(hf_folder: Path, config: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    arch = architectures.of_config(config)
    model_arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch.gguf_name)
    table = TensorNameMap(model_arch, config["num_hidden_layers"])
    out = []
    for hf, array in _stack_experts(load_file(str(hf_folder / "model.safetensors")), config).items():
        name = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        # llama.cpp's LlamaModel permutes, and writes Llama and Mixtral: not the flag the reader goes by
        out.append((name, permute(hf, array, config) if arch.gguf_name == "llama" else array))
    return out


def _stack_experts(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Each MoE layer's experts' projections as one ``[experts, out, in]`` array each, under the
    name llama.cpp's converter gives the stack before mapping it (``...experts.w1.weight``)."""
    model = architectures.config_from(config)
    arch, experts = model.architecture, model.experts
    if not isinstance(arch, MixtureOfExperts) or experts is None:
        return tensors
    out = dict(tensors)
    for layer in sorted(experts.layers):
        per_expert = [arch.expert(layer, e) for e in range(experts.count)]
        for k, stacked in enumerate(arch.stacked(layer)):
            out[stacked] = np.stack([out.pop(names[k]) for names in per_expert])
    return out


def permute(hf: str, array: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """``LlamaModel.permute``: each head's rows from (first half, second half) to interleaved pairs."""
    if ".q_proj." in hf:
        heads = config["num_attention_heads"]
    elif ".k_proj." in hf:
        heads = config["num_key_value_heads"]
    else:
        return array
    rows = array.shape[0]
    return array.reshape(heads, 2, rows // heads // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def _add(writer: GGUFWriter, name: str, array: np.ndarray, kind: str) -> None:
    if kind == "F32":
        writer.add_tensor(name, array.astype(np.float32))
    elif kind == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    elif kind == "I8":
        writer.add_tensor(name, np.clip(array * 100, -127, 127).astype(np.int8))
    else:
        qtype = GGMLQuantizationType[kind]
        writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
