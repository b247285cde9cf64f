"""GGUF metadata -> config.json: the engine reads the same model from it as from the original
Hugging Face config; a value of the wrong type, out of bounds or missing fails naming the key."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFWriter, RopeScalingType

from splitbus.architectures import config_from
from splitbus.env import load_env
from splitbus.model_files.fetch import SOURCES, fetched_path
from splitbus.model_files.gguf import metadata, open_reader, prepare, weights
from splitbus.tokenization import ModelFilesError
from tests.architectures.toy import register_toy
from tests.model_files.gguf.writer import write_gguf

BASE: dict[str, Any] = {
    "llama.vocab_size": 300,
    "llama.block_count": 2,
    "llama.context_length": 64,
    "llama.embedding_length": 64,
    "llama.feed_forward_length": 128,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.attention.layer_norm_rms_epsilon": 1e-6,
}


def _config(path: Path) -> dict[str, Any]:
    return metadata.hf_config(open_reader(path), path)


def _metadata_only(path: Path, changes: dict[str, Any], arch: str = "llama") -> Path:
    """A GGUF without tensors, of ``arch`` (BASE's keys under its prefix); a value None leaves the
    key out, a str/bool/float/int sets its type."""
    writer = GGUFWriter(path, arch)
    base = {arch + key.removeprefix("llama"): value for key, value in BASE.items()}
    for key, value in (base | changes).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_config_describes_the_same_model_as_the_original(hf_folder: Path, tmp_path: Path) -> None:
    original = json.loads((hf_folder / "config.json").read_text())
    config = _config(write_gguf(hf_folder, tmp_path / "m.gguf", "Q8_0"))
    assert config_from(config) == config_from(original)
    assert config["tie_word_embeddings"] == original["tie_word_embeddings"]
    assert config["eos_token_id"] == original["eos_token_id"]
    assert config["rms_norm_eps"] == original["rms_norm_eps"]  # 1e-06, not float32's 9.99999997e-07
    json.dumps(config)  # plain JSON types only


def test_metadata_only_file_gives_defaults(tmp_path: Path) -> None:
    config = _config(_metadata_only(tmp_path / "m.gguf", {}))
    assert config["head_dim"] == 16 and config["rope_theta"] == metadata.DEFAULT_ROPE_THETA
    assert config["tie_word_embeddings"] is True and "eos_token_id" not in config
    # An explicit head size (not hidden / heads), as Hugging Face's head_dim allows.
    assert _config(_metadata_only(tmp_path / "k.gguf", {"llama.attention.key_length": 32}))["head_dim"] == 32


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"general.architecture": None}, "general.architecture is missing"),
        ({"llama.block_count": None}, "metadata key llama.block_count is missing"),
        ({"llama.vocab_size": None}, "metadata key llama.vocab_size is missing"),
        ({"llama.block_count": "2"}, r"llama.block_count has type STRING, expected one of \["),
        ({"llama.attention.head_count": 0}, r"llama.attention.head_count = 0 is outside \[1, 1024\]"),
        ({"llama.attention.head_count_kv": 3}, "4 attention heads are not a multiple of 3 KV heads"),
        ({"llama.embedding_length": 1 << 30}, "llama.embedding_length = 1073741824 is outside"),
        ({"llama.attention.layer_norm_rms_epsilon": 0.0}, "layer_norm_rms_epsilon = 0.0 is outside"),
        ({"llama.rope.freq_base": float("nan")}, "llama.rope.freq_base = nan is outside"),
        ({"llama.rope.dimension_count": 8}, r"head dimensions \(key 16, value 16, rotated 8\) are not supported"),
        ({"llama.attention.key_length": 15}, r"\(key 15, value 15, rotated 15\)"),
        ({"llama.rope.scaling.type": RopeScalingType.LINEAR.value}, "RoPE scaling 'linear' is not supported"),
        ({"llama.expert_count": 1025}, r"llama.expert_count = 1025 is outside \[0, 1024\]"),
        ({"llama.expert_count": 4}, "metadata key llama.expert_used_count is missing"),
        ({"llama.expert_count": 4, "llama.expert_used_count": 5}, r"llama.expert_used_count = 5 is outside \[1, 4\]"),
        ({"llama.expert_count": 4, "llama.expert_used_count": 0}, r"llama.expert_used_count = 0 is outside \[1, 4\]"),
        (
            {"llama.expert_count": 4, "llama.expert_used_count": 2, "llama.expert_feed_forward_length": 0},
            r"llama.expert_feed_forward_length = 0 is outside \[1, 262144\]",
        ),
        ({"llama.expert_count": 4, "llama.expert_used_count": 2, "llama.expert_weights_norm": 1}, "has type UINT32"),
    ],
)
def test_bad_metadata_fails_naming_the_key(tmp_path: Path, changes: dict[str, Any], problem: str) -> None:
    path = tmp_path / "m.gguf"
    if changes == {"general.architecture": None}:  # GGUFWriter always writes it: rename the key in place
        written = _metadata_only(tmp_path / "x.gguf", {}).read_bytes()
        path.write_bytes(written.replace(b"general.architecture", b"general.architectur_"))
    else:
        _metadata_only(path, changes)
    with pytest.raises(ModelFilesError, match=problem) as info:
        _config(path)
    assert str(info.value).startswith(str(path))


def test_a_llama_file_with_experts_is_mixtral(tmp_path: Path) -> None:
    """Mixtral's GGUF says ``llama`` with ``llama.expert_count`` > 0; its experts are as wide as
    ``feed_forward_length`` (llama.cpp writes no expert width for it) and always renormalised."""
    config = _config(_metadata_only(tmp_path / "m.gguf", {"llama.expert_count": 8, "llama.expert_used_count": 2}))
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (8, 2, 128)
    experts = config_from(config).experts
    assert experts is not None and experts.renormalise and experts.layers == {0, 1}
    dense = _config(_metadata_only(tmp_path / "dense.gguf", {"llama.expert_count": 0}))
    assert dense["architectures"] == ["LlamaForCausalLM"] and "num_local_experts" not in dense


@pytest.mark.parametrize("norm", [None, True, False])
def test_a_qwen3moe_file_is_qwen3_moe_with_experts_in_every_layer(tmp_path: Path, norm: bool | None) -> None:
    """``expert_feed_forward_length`` is its experts' width (``feed_forward_length`` the dense
    MLP's); the top-k weights are renormalised unless ``expert_weights_norm`` is false."""
    keys = {"qwen3moe.expert_count": 128, "qwen3moe.expert_used_count": 8, "qwen3moe.expert_feed_forward_length": 32}
    if norm is not None:
        keys["qwen3moe.expert_weights_norm"] = norm
    config = _config(_metadata_only(tmp_path / "m.gguf", keys, arch="qwen3moe"))
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (128, 8, 32)
    assert config["norm_topk_prob"] is (norm is not False)
    model = config_from(config)
    assert model.experts is not None and model.experts.layers == {0, 1} and model.intermediate_size == 128


def test_a_qwen3moe_file_without_experts_fails_in_one_line(tmp_path: Path) -> None:
    """It has no tokenizer: the conversion would fail there if the architecture were not refused first."""
    path = _metadata_only(tmp_path / "m.gguf", {}, arch="qwen3moe")
    with pytest.raises(ModelFilesError) as info:
        prepare(path, tmp_path / "cache")
    assert str(info.value) == f"{path}: a 'qwen3moe' file without experts (qwen3moe.expert_count = 0) is not supported"


def test_other_architecture_fails(tiny_hf: Callable[[str], Path], tmp_path: Path) -> None:
    path = write_gguf(tiny_hf("llama"), tmp_path / "m.gguf", arch="phi2")
    with pytest.raises(ModelFilesError, match=r"m\.gguf: architecture 'phi2' is not supported; expected one of"):
        _config(path)


def test_a_registered_architecture_is_read_under_its_gguf_name(
    monkeypatch: pytest.MonkeyPatch, tiny_hf: Callable[[str], Path], tmp_path: Path
) -> None:
    """The converter takes its names from the one table: a file of a newly registered
    architecture is read under that architecture's GGUF name and mapped to its Hugging Face one."""
    register_toy(monkeypatch)
    config = _config(write_gguf(tiny_hf("llama"), tmp_path / "m.gguf", arch="toy"))
    assert config["architectures"] == ["ToyForCausalLM"] and config["model_type"] == "toy"
    original = json.loads((tiny_hf("llama") / "config.json").read_text())
    assert config["num_hidden_layers"] == original["num_hidden_layers"]  # the keys under toy.*


# The real model, where `splitbus fetch-model smollm2` puts it (SPLITBUS_DATA_DIR, else .splitbus where pytest runs).
SMOLLM2_GGUF = fetched_path(SOURCES["smollm2"], load_env().data_dir / "models")


def test_smollm2_config_and_tensor_plan() -> None:
    """The published shape of SmolLM2-135M-Instruct, and every one of its 272 tensors (Q4_1,
    Q8_0, F32) accepted by name, type and shape (nothing is dequantized here)."""
    if not SMOLLM2_GGUF.is_file():
        pytest.skip(f"{SMOLLM2_GGUF} is absent: `splitbus fetch-model smollm2` puts it there")
    reader = open_reader(SMOLLM2_GGUF)
    config = metadata.hf_config(reader, SMOLLM2_GGUF)
    shape = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    assert [config[k] for k in shape] == [30, 576, 9, 3, 64]
    assert (config["vocab_size"], config["rope_theta"], config["max_position_embeddings"]) == (49152, 100000.0, 8192)
    assert (config["tie_word_embeddings"], config["bos_token_id"], config["eos_token_id"]) == (True, 1, 2)
    assert len(weights.plan(reader, config, SMOLLM2_GGUF)) == len(reader.tensors) == 272
