"""A GGUF file's metadata -> the Hugging Face ``config.json`` of the same model (an architecture
that ``splitbus.architectures`` registers under the file's ``general.architecture``).

Every value is read through a typed accessor that checks the GGUF value type and a bound: the
file is untrusted, and these numbers size every tensor the converter allocates.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Final

import numpy as np
from gguf import GGUFReader, GGUFValueType, Keys

from splitbus import architectures
from splitbus.architectures import Architecture, Experts, MixtureOfExperts
from splitbus.architectures.base import MAX_EXPERTS, MAX_LAYERS
from splitbus.tokenization import ModelFilesError

DEFAULT_ROPE_THETA: Final = 10000.0
"""llama.cpp's default when ``{arch}.rope.freq_base`` is absent."""

_INTEGERS: Final = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)
_FLOATS: Final = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})

# Upper bounds far above any Llama/Qwen2 checkpoint, low enough that a lying header cannot make
# the converter allocate without limit before the tensor shapes are checked against them.
MAX_VOCAB: Final = 1 << 22
MAX_WIDTH: Final = 1 << 18
MAX_HEADS: Final = 1024
MAX_HEAD_DIM: Final = 1024
MAX_CONTEXT: Final = 1 << 24


class Fields:
    """Typed, bounds-checked reads of one file's metadata; errors name the file and the key."""

    def __init__(self, reader: GGUFReader, where: Path | str) -> None:
        self.reader = reader
        self.where = str(where)

    def fail(self, problem: str) -> ModelFilesError:
        return ModelFilesError(f"{self.where}: {problem}")

    def _scalar(self, key: str, kinds: frozenset[GGUFValueType]) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            return None
        if len(field.types) != 1 or field.types[0] not in kinds:
            names = "/".join(t.name for t in field.types)
            raise self.fail(f"metadata {key} has type {names}, expected one of {sorted(k.name for k in kinds)}")
        try:
            return field.contents()
        except UnicodeDecodeError as exc:  # the reader decodes strings as UTF-8 only when asked
            raise self.fail(f"metadata {key} holds text that is not UTF-8 ({exc.reason} at byte {exc.start})") from None

    def string(self, key: str) -> str | None:
        value = self._scalar(key, frozenset({GGUFValueType.STRING}))
        return value if isinstance(value, str) else None

    def integer(self, key: str, low: int, high: int, default: int | None = None) -> int:
        value = self._scalar(key, _INTEGERS)
        if value is None:
            return self._default(key, default)
        if not low <= int(value) <= high:
            raise self.fail(f"metadata {key} = {value} is outside [{low}, {high}]")
        return int(value)

    def number(self, key: str, low: float, high: float, default: float | None = None) -> float:
        value = self._scalar(key, _FLOATS)
        if value is None:
            return self._default(key, default)
        if not (math.isfinite(value) and low < value <= high):
            raise self.fail(f"metadata {key} = {value} is outside ({low}, {high}]")
        if self._type(key) != GGUFValueType.FLOAT32:
            return float(value)
        # A float32's shortest decimal (1e-05, not 9.999999747378752e-06) is the value the
        # Hugging Face config had, and it parses back to the same float32.
        return float(str(np.float32(value)))

    def boolean(self, key: str, default: bool) -> bool:
        value = self._scalar(key, frozenset({GGUFValueType.BOOL}))
        return default if value is None else bool(value)

    def _type(self, key: str) -> GGUFValueType | None:
        field = self.reader.get_field(key)
        return field.types[0] if field is not None and field.types else None

    def _default(self, key: str, default: Any) -> Any:
        if default is None:
            raise self.fail(f"metadata key {key} is missing")
        return default


def architecture(fields: Fields) -> Architecture:
    """The architecture ``general.architecture`` names, with experts when ``{arch}.expert_count``
    is above 0 (Mixtral's files say ``llama``), if it is one the engine runs."""
    name = fields.string(Keys.General.ARCHITECTURE)
    if name is None:
        raise fields.fail(f"metadata key {Keys.General.ARCHITECTURE} is missing")
    known = sorted({a.gguf_name for a in architectures.registered() if a.gguf_layout})
    if name not in known:
        raise fields.fail(f"architecture {name!r} is not supported; expected one of {known}")
    key = Keys.LLM.EXPERT_COUNT.format(arch=name)
    count = fields.integer(key, 0, MAX_EXPERTS, default=0)
    found = architectures.of_gguf(name, experts=count > 0)
    if found is None:
        raise fields.fail(
            f"a {name!r} file {'with' if count else 'without'} experts ({key} = {count}) is not supported"
        )
    return found


def hf_config(reader: GGUFReader, where: Path | str) -> dict[str, Any]:
    """The ``config.json`` that describes this file's model; ModelFilesError when it cannot."""
    fields = Fields(reader, where)
    found = architecture(fields)
    arch = found.gguf_name  # the prefix of its metadata keys
    _refuse_rope_scaling(fields, arch)
    heads = fields.integer(Keys.Attention.HEAD_COUNT.format(arch=arch), 1, MAX_HEADS)
    kv_heads = fields.integer(Keys.Attention.HEAD_COUNT_KV.format(arch=arch), 1, heads, default=heads)
    hidden = fields.integer(Keys.LLM.EMBEDDING_LENGTH.format(arch=arch), 1, MAX_WIDTH)
    if heads % kv_heads:
        raise fields.fail(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    config: dict[str, Any] = {
        "architectures": [found.hf_name],
        "model_type": found.model_type,
        "vocab_size": _vocab_size(fields, arch),
        "hidden_size": hidden,
        "intermediate_size": fields.integer(Keys.LLM.FEED_FORWARD_LENGTH.format(arch=arch), 1, MAX_WIDTH),
        "num_hidden_layers": fields.integer(Keys.LLM.BLOCK_COUNT.format(arch=arch), 1, MAX_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": _head_dim(fields, arch, hidden, heads),
        "rms_norm_eps": fields.number(Keys.Attention.LAYERNORM_RMS_EPS.format(arch=arch), 0.0, 1.0),
        "rope_theta": fields.number(Keys.Rope.FREQ_BASE.format(arch=arch), 0.0, 1e12, default=DEFAULT_ROPE_THETA),
        "max_position_embeddings": fields.integer(Keys.LLM.CONTEXT_LENGTH.format(arch=arch), 1, MAX_CONTEXT),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        # Llama's q/k/v biases are optional (Qwen2 always has them and needs no key).
        "attention_bias": any(t.name == "blk.0.attn_q.bias" for t in reader.tensors),
        "torch_dtype": "float32",
    }
    return config | _experts(fields, found, config) | _special_ids(fields, config["vocab_size"])


def _vocab_size(fields: Fields, arch: str) -> int:
    """``{arch}.vocab_size``; older files only have the token list, whose length it is."""
    tokens = fields.reader.get_field(Keys.Tokenizer.LIST)
    default = len(tokens.data) if tokens is not None and tokens.types[:1] == [GGUFValueType.ARRAY] else None
    return fields.integer(Keys.LLM.VOCAB_SIZE.format(arch=arch), 1, MAX_VOCAB, default=default)


def _head_dim(fields: Fields, arch: str, hidden: int, heads: int) -> int:
    """``attention.key_length``, else hidden / heads (llama.cpp's defaults). The engine rotates
    the whole head, so ``rope.dimension_count``, when there, must equal it (no partial RoPE)."""
    fallback = hidden // heads if hidden % heads == 0 else None
    head_dim = fields.integer(Keys.Attention.KEY_LENGTH.format(arch=arch), 2, MAX_HEAD_DIM, default=fallback)
    value_dim = fields.integer(Keys.Attention.VALUE_LENGTH.format(arch=arch), 2, MAX_HEAD_DIM, default=head_dim)
    rotated = fields.integer(Keys.Rope.DIMENSION_COUNT.format(arch=arch), 2, MAX_HEAD_DIM, default=head_dim)
    if head_dim % 2 or value_dim != head_dim or rotated != head_dim:
        raise fields.fail(
            f"head dimensions (key {head_dim}, value {value_dim}, rotated {rotated}) are not supported: "
            "the engine needs equal, even key and value dimensions with RoPE on all of them"
        )
    return head_dim


def _experts(fields: Fields, found: Architecture, config: dict[str, Any]) -> dict[str, Any]:
    """A MoE file's experts as its architecture's ``config.json`` keys; none for a dense one.
    ``expert_feed_forward_length`` is absent from a Mixtral file (llama.cpp sizes a ``llama``
    file's experts by ``feed_forward_length``); llama.cpp renormalises the top-k weights of both
    layouts unless ``expert_weights_norm`` says otherwise."""
    if not isinstance(found, MixtureOfExperts):
        return {}
    arch = found.gguf_name
    count = fields.integer(Keys.LLM.EXPERT_COUNT.format(arch=arch), 1, MAX_EXPERTS)
    experts = Experts(
        count,
        fields.integer(Keys.LLM.EXPERT_USED_COUNT.format(arch=arch), 1, count),
        fields.integer(
            Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch), 1, MAX_WIDTH, default=config["intermediate_size"]
        ),
        fields.boolean(Keys.LLM.EXPERT_WEIGHTS_NORM.format(arch=arch), default=True),
        frozenset(range(config["num_hidden_layers"])),
    )
    return found.gguf_keys(experts)


def _refuse_rope_scaling(fields: Fields, arch: str) -> None:
    """The engine implements plain RoPE; a scaled one would run and answer wrongly."""
    scaling = fields.string(Keys.Rope.SCALING_TYPE.format(arch=arch))
    if scaling not in (None, "none"):
        raise fields.fail(f"RoPE scaling {scaling!r} is not supported (the engine implements plain RoPE)")
    if any(t.name == "rope_freqs.weight" for t in fields.reader.tensors):
        raise fields.fail("rope_freqs.weight (Llama 3.1 RoPE frequency scaling) is not supported")


def _special_ids(fields: Fields, vocab: int) -> dict[str, int]:
    ids = {
        "bos_token_id": fields.integer(Keys.Tokenizer.BOS_ID, 0, vocab - 1, default=-1),
        "eos_token_id": fields.integer(Keys.Tokenizer.EOS_ID, 0, vocab - 1, default=-1),
    }
    return {name: value for name, value in ids.items() if value >= 0}
