"""A GGUF file's tensors -> Hugging Face names, layout and float32, checked before any is converted.

Names come from the gguf package's own map (``TensorNameMap``: Hugging Face name -> GGUF name,
the table llama.cpp's converter writes with), dequantization from ``gguf.quants.dequantize``.
llama.cpp's converter permutes the rows of a Llama model's Q and K projections so that its RoPE
kernel can rotate adjacent pairs (``LLAMA_ROPE_TYPE_NORM``); the engine rotates halves, as the
Hugging Face model does, so those rows are put back (``Architecture.gguf_permuted_qk``). Qwen2
runs with NeoX RoPE (halves) in llama.cpp too, and its converter leaves the rows alone.

A MoE file (Mixtral as ``llama``, ``qwen3moe``) keeps each layer's experts stacked: one tensor per
projection, ``ffn_{gate,up,down}_exps``, ``[experts, out, in]`` in numpy's order (GGUF lists the
dimensions the other way round). The stacked tensor is checked whole, against the metadata's
expert count and width, and each expert's slice becomes a Hugging Face tensor of its own
(``...experts.E.w1.weight``), as the engine's loader reads a Hugging Face folder. The router
(``ffn_gate_inp``) is a Linear ``[experts, hidden]`` in both layouts, mapped like any other tensor.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, ReaderTensor, TensorNameMap
from gguf.quants import dequantize

from splitbus import architectures
from splitbus.architectures import MixtureOfExperts, ModelConfig, Shapes
from splitbus.tokenization import ModelFilesError

Source = tuple[str, int | None]
"""Where a Hugging Face tensor lies in a GGUF file: the Hugging Face-style name of the tensor that
holds it (its own, or its experts' stacked one) and its index in that stack (None: all of it)."""


@dataclass(frozen=True)
class Part:
    """One Hugging Face tensor in the file: a whole GGUF tensor, or one expert's slice of a stacked one."""

    tensor: ReaderTensor
    expert: int | None = None
    """The expert's index along the stacked tensor's first (numpy) axis; None: the whole tensor."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Its shape in Hugging Face layout."""
        shape = hf_shape(self.tensor)
        return shape if self.expert is None else shape[1:]

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    def raw(self) -> np.ndarray:
        """Its data as the reader maps it (quantized blocks along the last axis): a view, so that
        an expert is dequantized alone, not its whole stack."""
        return self.tensor.data if self.expert is None else self.tensor.data[self.expert]


def hf_shapes(config: dict[str, Any]) -> Shapes:
    """Every tensor the engine loads, Hugging Face names and layout (Linear weights are [out, in]):
    the layout of the model's architecture, as the paddle engine's loader reads it."""
    return architectures.config_from(config).tensor_shapes()


def gguf_names(arch: str, layers: int, hf_names: list[str]) -> dict[str, str]:
    """GGUF name -> Hugging Face name, for the names the engine loads (a stacked experts' tensor
    under the name llama.cpp's converter gives it: ``MixtureOfExperts.stacked``)."""
    model_arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    table = TensorNameMap(model_arch, layers)
    names = {}
    for hf in hf_names:
        name = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:  # a gguf package whose table lost a Llama name: a bug here, not in the file
            raise RuntimeError(f"the gguf package has no GGUF name for {hf}")
        names[name] = hf
    return names


def sources(model: ModelConfig) -> dict[str, Source]:
    """Every tensor the engine loads (Hugging Face names) -> where it lies in a GGUF file: its
    own tensor, or for an expert's projection, its slice of the layer's stacked one."""
    found: dict[str, Source] = {hf: (hf, None) for hf in model.tensor_shapes()}
    arch, experts = model.architecture, model.experts
    if isinstance(arch, MixtureOfExperts) and experts is not None:
        for layer in sorted(experts.layers):
            for e in range(experts.count):
                found |= _expert_sources(arch, layer, e)
    return found


def _expert_sources(arch: MixtureOfExperts, layer: int, expert: int) -> dict[str, Source]:
    """One expert's gate, up and down projections: its row of the layer's three stacks."""
    return {hf: (stacked, expert) for hf, stacked in zip(arch.expert(layer, expert), arch.stacked(layer), strict=True)}


def file_shapes(model: ModelConfig) -> Shapes:
    """The tensors a GGUF file of ``model`` holds, by Hugging Face-style name, in numpy's order:
    a stacked experts' tensor is ``[experts, *one expert's shape]``, a router ``[experts, hidden]``.
    Listed from the same model with one expert, so that a file whose metadata claims 1024 layers
    of 1024 experts it does not hold fails its check before 3 million expert names are listed
    (seconds and gigabytes)."""
    arch, experts = model.architecture, model.experts
    if not isinstance(arch, MixtureOfExperts) or experts is None:
        return model.tensor_shapes()
    one = replace(model, experts=replace(experts, count=1, per_token=1))
    shapes = one.tensor_shapes() | {arch.router(i): (experts.count, model.hidden_size) for i in experts.layers}
    return {name: shapes[hf] if e is None else (experts.count, *shapes[hf]) for hf, (name, e) in sources(one).items()}


@functools.cache
def dequantizable() -> frozenset[GGMLQuantizationType]:
    """The tensor types ``gguf.quants.dequantize`` handles, found by asking it (one zero block
    each): the package grows types between releases, and a hand list would go stale."""
    found = set()
    for qtype, (block, type_size) in GGML_QUANT_SIZES.items():
        size = block * type_size if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else type_size
        try:
            dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        found.add(qtype)
    return frozenset(found)


def plan(reader: GGUFReader, config: dict[str, Any], where: Path | str) -> dict[str, Part]:
    """Hugging Face name -> the part of the file that holds it, every GGUF tensor's name, type
    and shape checked first."""
    model = architectures.config_from(config, where)
    shapes = file_shapes(model)
    names = gguf_names(model.architecture.gguf_name, model.layers, list(shapes))
    found = {t.name: t for t in reader.tensors}
    problems = [p for p in _problems(found, names, shapes, model.arch) if p]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ModelFilesError(f"{where}: " + "; ".join(problems[:5]) + more)
    tensors = {hf: found[name] for name, hf in names.items()}
    return {hf: Part(tensors[name], e) for hf, (name, e) in sources(model).items()}


def _problems(found: dict[str, ReaderTensor], names: dict[str, str], shapes: Shapes, model_type: str) -> list[str]:
    """What is wrong with the file's tensors ("" for a tensor that is right): names it should not
    have, names it lacks, and each expected tensor's type and shape."""
    problems = [f"unexpected tensor {name} (not part of a {model_type} model)" for name in found if name not in names]
    problems += [f"missing tensor {name} ({hf})" for name, hf in names.items() if name not in found]
    return problems + [_problem(t, shapes[names[t.name]]) for t in found.values() if t.name in names]


def _problem(tensor: ReaderTensor, expected: tuple[int, ...]) -> str:
    if tensor.tensor_type not in dequantizable():
        supported = ", ".join(sorted(t.name for t in dequantizable()))
        return f"tensor {tensor.name} has type {tensor.tensor_type.name}, which cannot be dequantized ({supported} can)"
    shape = hf_shape(tensor)
    if shape != expected:
        return f"tensor {tensor.name} has shape {list(shape)}, expected {list(expected)} from the metadata"
    return ""


def hf_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first; numpy and Hugging Face outermost first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def tensors(reader: GGUFReader, config: dict[str, Any], where: Path | str) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor as float32 in Hugging Face layout, one at a time (the file is memory-mapped)."""
    for hf, part in plan(reader, config, where).items():
        yield hf, _float32(hf, part, config)


def _float32(hf: str, part: Part, config: dict[str, Any]) -> np.ndarray:
    array = dequantize(part.raw(), part.tensor.tensor_type).reshape(part.shape)
    if architectures.of_config(config).gguf_permuted_qk:
        array = _unpermute(hf, array, config)
    return np.ascontiguousarray(array, dtype="<f4")


def _unpermute(name: str, array: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """Undo ``LlamaModel.permute`` of convert_hf_to_gguf.py: within each head, GGUF rows come in
    (first half, second half) pairs; the Hugging Face layout has the two halves one after the
    other. Applies to Q's and K's weights and biases (K with the KV head count)."""
    if ".self_attn.q_proj." in name:
        heads = config["num_attention_heads"]
    elif ".self_attn.k_proj." in name:
        heads = config["num_key_value_heads"]
    else:
        return array
    rows = array.shape[0]
    return array.reshape(heads, rows // heads // 2, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def float32_bytes(reader: GGUFReader, config: dict[str, Any], where: Path | str) -> int:
    """The size of the tensors :func:`write` writes (every planned tensor as float32)."""
    return sum(part.n_elements * 4 for part in plan(reader, config, where).values())


def write(reader: GGUFReader, config: dict[str, Any], path: Path, where: Path | str) -> None:
    """``model.safetensors`` in float32, one tensor at a time. The safetensors library writes only
    from a dict of every array, which held the whole float32 model (20 times a 1.5-bit file); but
    the format is a JSON header of names, shapes and offsets, then the tensors' bytes in that
    order, and all of it is known from the plan. So the header is written first and each tensor
    after it, dequantized, written and dropped: the peak is one tensor's float32 copy (one
    expert's, not its stack's)."""
    planned = plan(reader, config, where)
    with path.open("wb") as f:
        f.write(safetensors_header({hf: part.shape for hf, part in planned.items()}))
        for hf, part in planned.items():
            f.write(_float32(hf, part, config).data)


def safetensors_header(shapes: dict[str, tuple[int, ...]]) -> bytes:
    """The safetensors header of float32 tensors of these shapes, stored in this order: its
    length (u64, little-endian), then its JSON padded with spaces to 8 bytes, as the library pads."""
    entries, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        entries[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
