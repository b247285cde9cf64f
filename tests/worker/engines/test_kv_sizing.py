"""The engine sizes its own KV cache: blocks from a memory budget, its model's layer and head
shapes and its own dtype (the CLI used to assume fp32 for every engine)."""

from __future__ import annotations

import pytest

from splitbus.architectures import ModelConfig, config_from
from splitbus.worker.engines import DTYPE_BYTES, kv_bytes_per_token
from splitbus.worker.engines.paddle import KV_DTYPE, kv_blocks

MIB = 2**20
QWEN25_05B_SHAPE = {  # 24 layers, 2 KV heads of 64
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}
TINY_SHAPE = {  # make-tiny-model's llama: 4 layers, 2 KV heads of 64
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 259,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MODELS = {"tiny": config_from(TINY_SHAPE), "qwen2.5-0.5b": config_from(QWEN25_05B_SHAPE)}


def _fp32_blocks_as_the_cli_computed_them(model: ModelConfig, megabytes: int, block_size: int) -> int:
    """cli/worker_cmd.py's ``_blocks_for`` before engines sized their own caches."""
    bytes_per_block = 2 * model.layers * model.kv_heads * model.head_dim * 4 * block_size  # K and V, fp32
    return max(2, megabytes * 1024 * 1024 // bytes_per_block)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("megabytes", [2, 256, 4096])  # budgets of 2 blocks and more: fewer is an error (below)
@pytest.mark.parametrize("block_size", [16, 32])
def test_fp32_gives_the_numbers_of_before(name: str, megabytes: int, block_size: int) -> None:
    model = MODELS[name]
    expected = _fp32_blocks_as_the_cli_computed_them(model, megabytes, block_size)
    assert kv_blocks(model, megabytes * MIB, block_size, "float32") == expected


def test_the_paddle_engine_sizes_in_float32_its_compute_dtype() -> None:
    assert KV_DTYPE == "float32"
    assert kv_blocks(MODELS["tiny"], 256 * MIB, 16) == 4096  # 4 layers x 2 KV heads x 64 x 2 (K, V) x 4 B x 16


@pytest.mark.parametrize(("dtype", "itemsize"), [("float32", 4), ("bfloat16", 2), ("float16", 2), ("float8_e4m3fn", 1)])
def test_other_dtypes_take_their_own_size(dtype: str, itemsize: int) -> None:
    model = MODELS["qwen2.5-0.5b"]
    per_token = 2 * 24 * 2 * 64 * itemsize
    assert kv_bytes_per_token(model.layers, model.kv_heads, model.head_dim, dtype) == per_token
    assert kv_blocks(model, 256 * MIB, 16, dtype) == 256 * MIB // (per_token * 16)
    assert DTYPE_BYTES[dtype] == itemsize


def test_half_precision_holds_twice_the_blocks_of_fp32() -> None:
    model = MODELS["qwen2.5-0.5b"]
    assert kv_blocks(model, 256 * MIB, 16, "bfloat16") == 2 * kv_blocks(model, 256 * MIB, 16, "float32") + 1
    assert kv_blocks(model, 384 * MIB, 16, "float16") == 2 * kv_blocks(model, 384 * MIB, 16, "float32")


def test_a_budget_short_of_the_scratch_block_and_one_more_is_a_clear_error() -> None:
    model = MODELS["qwen2.5-0.5b"]  # 12 KiB a token in bf16: 2 blocks of 16 tokens are 384 KiB
    assert kv_blocks(model, 2 * 16 * 12_288, 16, "bfloat16") == 2
    with pytest.raises(ValueError, match=r"budget, 0\.4 MiB, holds 1 block\(s\) of 16 tokens; it needs 2 \(1 MiB\)"):
        kv_blocks(model, 2 * 16 * 12_288 - 1, 16, "bfloat16")


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV cache dtype 'float12'"):
        kv_blocks(MODELS["tiny"], 256 * MIB, 16, "float12")
