"""The one table of model architectures: each registered one is complete, names are unique, and
every reader (the engine's config, the tiny model, ``make-tiny-model --arch``, the default model
of ``splitbus up``) takes a new one with no edit of its own."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import MODEL_ARCH_NAMES

from splitbus import architectures
from splitbus.architectures import Architecture, MixtureOfExperts
from splitbus.cli import model_cmd
from splitbus.env import load_env
from splitbus.tokenization import ModelFilesError
from splitbus.worker.engines.paddle.tiny import tiny_config
from splitbus.worker.engines.sim import SimType
from tests.architectures.toy import TOY, register_toy

TODAY = {"LlamaForCausalLM": ("llama", "llama"), "Qwen2ForCausalLM": ("qwen2", "qwen2")}


def _arch_choices() -> list[str]:
    parser = argparse.ArgumentParser()
    model_cmd.add_parser(parser.add_subparsers(), load_env({}))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["make-tiny-model"]
    return list(next(a for a in sub._actions if a.dest == "arch").choices)


def test_the_package_registers_llama_and_qwen2_by_their_hugging_face_names() -> None:
    found = {a.hf_name: (a.model_type, a.gguf_name) for a in architectures.registered()}
    assert TODAY.items() <= found.items()
    llama, qwen2 = architectures.get("LlamaForCausalLM"), architectures.get("Qwen2ForCausalLM")
    assert qwen2.qkv_bias and not llama.qkv_bias
    assert llama.gguf_permuted_qk and not qwen2.gguf_permuted_qk


@pytest.mark.parametrize("arch", architectures.registered(), ids=lambda a: a.hf_name)
def test_each_architecture_is_complete(arch: Architecture) -> None:
    """Its tiny config reads back as its own, its tensors are laid out, and llama.cpp's gguf
    package knows its GGUF name (the converter takes tensor names from there)."""
    config = architectures.config_from(tiny_config(arch.model_type, 300, hidden=64, layers=2))
    assert config.architecture is arch and config.arch == arch.model_type
    shapes = config.tensor_shapes()
    assert "model.embed_tokens.weight" in shapes and all(min(shape) >= 1 for shape in shapes.values())
    assert ("lm_head.weight" in shapes) is not arch.tiny_ties_embeddings
    assert arch.gguf_name in MODEL_ARCH_NAMES.values()
    assert arch.forward  # the paddle engine's test checks it runs it


def test_every_reader_takes_a_new_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    toy = register_toy(monkeypatch)
    raw = tiny_config("toy", 300, hidden=64, layers=2)
    assert raw["architectures"] == ["ToyForCausalLM"] and raw["tie_word_embeddings"] is True
    config = architectures.config_from(raw)
    assert config.architecture is toy and config.qkv_bias  # its own flag, no attention_bias key
    assert "model.layers.1.self_attn.v_proj.bias" in config.tensor_shapes()
    assert "toy" in _arch_choices() and architectures.of_gguf("toy") is toy
    assert architectures.of_model_type("toy") is toy


def test_the_default_model_is_the_default_architecture(tmp_path: Path) -> None:
    SimType().make_default_model(tmp_path)  # EngineType's: a tokenizer and a config.json
    raw = json.loads((tmp_path / "config.json").read_text())
    assert architectures.of_config(raw).model_type == architectures.DEFAULT == "llama"


def test_names_are_unique(monkeypatch: pytest.MonkeyPatch) -> None:
    toy = register_toy(monkeypatch)
    assert architectures.register(TOY) is toy  # the same one again is no clash
    for clash in (
        replace(TOY, model_type="other", gguf_name="other"),
        replace(TOY, hf_name="OtherForCausalLM", gguf_name="other"),
        replace(TOY, hf_name="OtherForCausalLM", model_type="other"),
    ):
        with pytest.raises(ValueError, match="shares a name with the registered 'ToyForCausalLM'"):
            architectures.register(clash)
    # a GGUF name is shared by one architecture with experts and one without, never by two of either
    moe = MixtureOfExperts("ToyMoeForCausalLM", model_type="toy_moe", gguf_name="toy")
    assert architectures.register(moe) is moe and architectures.of_gguf("toy", experts=True) is moe
    with pytest.raises(ValueError, match="shares a name with the registered 'ToyMoeForCausalLM'"):
        architectures.register(replace(moe, hf_name="OtherMoeForCausalLM", model_type="other"))


def test_unknown_architectures_are_clear_errors() -> None:
    unknown = r"c\.json: architecture \['GPT2LMHeadModel'\] is not supported; expected one of \[.*'LlamaForCausalLM'"
    with pytest.raises(ModelFilesError, match=unknown):
        architectures.config_from({"architectures": ["GPT2LMHeadModel"]}, "c.json")
    with pytest.raises(ModelFilesError, match="architecture missing is not supported"):
        architectures.config_from({})
    with pytest.raises(ValueError, match=r"arch must be one of \[.*'llama', .*'qwen2'.*\]"):
        architectures.of_model_type("gpt2")
    with pytest.raises(ValueError, match="got 'GPT2LMHeadModel'"):
        architectures.get("GPT2LMHeadModel")
    assert architectures.of_gguf("phi2") is None


def test_a_config_with_a_bad_value_names_it() -> None:
    raw = tiny_config("llama", 300)
    with pytest.raises(ModelFilesError, match="config.json: missing key 'hidden_size'"):
        architectures.config_from({k: v for k, v in raw.items() if k != "hidden_size"})
    with pytest.raises(ModelFilesError, match="bad value"):
        architectures.config_from(raw | {"num_hidden_layers": "four"})
    with pytest.raises(ModelFilesError, match="multiple of num_key_value_heads"):
        architectures.config_from(raw | {"num_key_value_heads": 3})


def test_the_table_imports_neither_paddle_nor_gguf() -> None:
    code = (
        "import sys; from splitbus import architectures; architectures.registered(); "
        "assert not {'paddle', 'gguf'} & set(sys.modules), 'imported paddle or gguf'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_gguf_file_picks_a_moe_architecture_by_its_experts() -> None:
    """Mixtral shares llama.cpp's ``llama`` name with Llama: a file with experts is Mixtral, one
    without is Llama; ``qwen3moe`` is Qwen3-MoE, with experts only."""
    mixtral, qwen3_moe = architectures.get("MixtralForCausalLM"), architectures.get("Qwen3MoeForCausalLM")
    assert (mixtral.gguf_name, qwen3_moe.gguf_name) == ("llama", "qwen3moe")
    assert mixtral.gguf_layout and qwen3_moe.gguf_layout and qwen3_moe.qk_norm
    assert mixtral.gguf_permuted_qk and not qwen3_moe.gguf_permuted_qk  # llama.cpp: Llama's RoPE, NeoX's
    assert architectures.of_gguf("llama") is architectures.get("LlamaForCausalLM")
    assert architectures.of_gguf("llama", experts=True) is mixtral
    assert architectures.of_gguf("qwen3moe", experts=True) is qwen3_moe
    assert architectures.of_gguf("qwen3moe") is None and architectures.of_gguf("qwen2", experts=True) is None
    for arch in (mixtral, qwen3_moe):
        config = architectures.config_from(tiny_config(arch.model_type, 300, hidden=64, layers=2))
        assert config.experts is not None and config.experts.count == 4
