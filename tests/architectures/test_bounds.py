"""A config.json is untrusted: its sizes are bounded before any tensor is listed."""

from __future__ import annotations

import pytest

from splitbus import architectures
from splitbus.architectures.base import MAX_LAYERS
from splitbus.tokenization import ModelFilesError
from splitbus.worker.engines.paddle.tiny import tiny_config


def test_a_huge_moe_config_is_refused_before_its_tensors_are_listed() -> None:
    """100000 layers of 1024 experts would list ~3e8 tensor names (tens of GB) if it got that far."""
    raw = tiny_config("qwen3_moe", 300) | {"num_hidden_layers": 100_000, "num_experts": 1024}
    with pytest.raises(ModelFilesError, match=rf"bad value: num_hidden_layers = 100000 is outside \[1, {MAX_LAYERS}\]"):
        architectures.config_from(raw)


@pytest.mark.parametrize(
    "key",
    [
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "head_dim",
        "vocab_size",
    ],
)
def test_a_negative_size_is_a_bad_value_naming_its_key(key: str) -> None:
    raw = tiny_config("llama", 300) | {"head_dim": 16}
    with pytest.raises(ModelFilesError, match=rf"bad value: {key} = -4 is outside \[1, "):
        architectures.config_from(raw | {key: -4})


def test_zero_layers_is_a_bad_value() -> None:
    with pytest.raises(ModelFilesError, match=r"bad value: num_hidden_layers = 0 is outside"):
        architectures.config_from(tiny_config("llama", 300) | {"num_hidden_layers": 0})


def test_the_largest_layer_count_is_read() -> None:
    assert architectures.config_from(tiny_config("llama", 300) | {"num_hidden_layers": MAX_LAYERS}).layers == MAX_LAYERS


@pytest.mark.parametrize(
    ("arch", "bad", "named"),
    [
        ("mixtral", {"num_local_experts": 2000}, r"num_local_experts \(2000\) <= 1024"),
        ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) <= num_local_experts \(4\)"),
        ("qwen3_moe", {"moe_intermediate_size": 0}, r"moe_intermediate_size \(0\) >= 1"),
    ],
)
def test_an_experts_error_names_the_architectures_keys(arch: str, bad: dict[str, int], named: str) -> None:
    with pytest.raises(ModelFilesError, match=f"bad value: .*{named}"):
        architectures.config_from(tiny_config(arch, 300) | bad)
