"""GGUF tensors -> Hugging Face float32: exact for F32, within each quantization's error otherwise;
a type, shape or name the engine cannot use fails naming the tensor."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter
from safetensors.numpy import load_file

from splitbus.model_files.gguf import metadata, open_reader, prepare, weights
from splitbus.tokenization import ModelFilesError
from splitbus.worker.engines.paddle.tiny import make_tiny_model
from tests.model_files.gguf.writer import permute, write_gguf

BLOCK = 32
BOUNDS = {
    # Largest error per element, as a fraction of the largest |value| in its block of 32, from
    # gguf.quants' quantizers; the last term covers the block scale's rounding to float16.
    "F32": 0.0,
    "F16": 2**-11,  # round to nearest, 11-bit significand
    "Q8_0": 1 / 254 + 2**-10,  # scale amax/127, round to nearest: half a step
    "Q4_0": 1 / 8 + 2**-10,  # scale amax/8; the top level (+8) is clipped to +7: one step
    "Q4_1": 1 / 15 + 2**-9,  # 16 levels over [min, max]: half a step of (max - min)/15 <= 2 amax/15
}


def _convert(gguf_file: Path) -> dict[str, np.ndarray]:
    reader = open_reader(gguf_file)
    return dict(weights.tensors(reader, metadata.hf_config(reader, gguf_file), gguf_file))


@pytest.mark.parametrize("qtype", sorted(BOUNDS))
def test_tensors_match_the_source_within_the_quantization_error(hf_folder: Path, tmp_path: Path, qtype: str) -> None:
    source = load_file(str(hf_folder / "model.safetensors"))
    converted = _convert(write_gguf(hf_folder, tmp_path / "m.gguf", qtype))
    assert sorted(converted) == sorted(source)
    for name, expected in source.items():
        got = converted[name]
        assert got.dtype == np.float32 and got.shape == expected.shape, name
        if qtype == "F32" or expected.ndim == 1:  # 1-D tensors (norms, biases) stay F32 in the file
            np.testing.assert_array_equal(got, expected, err_msg=name)
            continue
        err = np.abs(got - expected).reshape(-1, BLOCK)
        amax = np.abs(expected).reshape(-1, BLOCK).max(axis=1, keepdims=True)
        assert (err <= BOUNDS[qtype] * amax + 1e-12).all(), name


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    config = {"num_attention_heads": 4, "num_key_value_heads": 2}
    q = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    k = np.arange(2 * 16 * 3, dtype=np.float32).reshape(32, 3)
    for name, array in (("model.layers.0.self_attn.q_proj.weight", q), ("model.layers.0.self_attn.k_proj.bias", k)):
        permuted = permute(name, array, config)
        assert not np.array_equal(permuted, array)
        np.testing.assert_array_equal(weights._unpermute(name, permuted, config), array)
    v = np.ones((32, 3), dtype=np.float32)
    assert weights._unpermute("model.layers.0.self_attn.v_proj.weight", v, config) is v


def test_unsupported_type_names_tensor_and_type(tiny_hf: Callable[[str], Path], tmp_path: Path) -> None:
    path = write_gguf(tiny_hf("llama"), tmp_path / "m.gguf", tensor_types={"blk.1.attn_v.weight": "I8"})
    with pytest.raises(ModelFilesError, match=r"m\.gguf: tensor blk\.1\.attn_v\.weight has type I8, which cannot be"):
        _convert(path)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"drop": frozenset({"blk.1.ffn_up.weight"})}, r"missing tensor blk\.1\.ffn_up\.weight"),
        (
            {"extra_tensors": {"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}},
            "unexpected tensor blk.0.attn_q_norm",
        ),
        (
            {"hparams": {"intermediate_size": 96}},
            r"blk\.0\.ffn_gate\.weight has shape \[128, 64\], expected \[96, 64\]",
        ),
    ],
)
def test_tensors_that_do_not_fit_the_metadata_fail(
    tiny_hf: Callable[[str], Path], tmp_path: Path, change: dict[str, Any], problem: str
) -> None:
    path = write_gguf(tiny_hf("llama"), tmp_path / "m.gguf", "Q8_0", **change)
    with pytest.raises(ModelFilesError, match=problem):
        _convert(path)


@pytest.mark.parametrize(
    ("arch", "change", "problem"),
    [
        # the metadata counts 3 experts, the file stacks 4: the router and every stack disagree
        (
            "mixtral",
            {"hparams": {"num_local_experts": 3}},
            r"tensor blk\.0\.ffn_gate_inp\.weight has shape \[4, 64\], expected \[3, 64\] from the metadata; .*"
            r"tensor blk\.0\.ffn_gate_exps\.weight has shape \[4, 64, 64\], expected \[3, 64, 64\]",
        ),
        (
            "qwen3_moe",
            {"hparams": {"moe_intermediate_size": 32}},
            r"tensor blk\.0\.ffn_down_exps\.weight has shape \[4, 64, 64\], expected \[4, 64, 32\]",
        ),
        ("qwen3_moe", {"drop": frozenset({"blk.1.ffn_up_exps.weight"})}, r"missing tensor blk\.1\.ffn_up_exps\.weight"),
        (  # one expert's matrix where the stack of them should be
            "mixtral",
            {
                "drop": frozenset({"blk.1.ffn_down_exps.weight"}),
                "extra_tensors": {"blk.1.ffn_down_exps.weight": np.ones((64, 64), np.float32)},
            },
            r"tensor blk\.1\.ffn_down_exps\.weight has shape \[64, 64\], expected \[4, 64, 64\]",
        ),
        (  # llama.cpp's old Mixtral layout, one tensor per expert, or a dense MLP in a qwen3moe file
            "mixtral",
            {"extra_tensors": {"blk.0.ffn_gate.0.weight": np.ones((64, 64), np.float32)}},
            r"unexpected tensor blk\.0\.ffn_gate\.0\.weight \(not part of a mixtral model\)",
        ),
        (
            "qwen3_moe",
            {"extra_tensors": {"blk.0.ffn_up.weight": np.ones((64, 64), np.float32)}},
            r"unexpected tensor blk\.0\.ffn_up\.weight \(not part of a qwen3_moe model\)",
        ),
    ],
)
def test_expert_tensors_that_do_not_fit_the_metadata_fail(
    tiny_hf: Callable[[str], Path], tmp_path: Path, arch: str, change: dict[str, Any], problem: str
) -> None:
    path = write_gguf(tiny_hf(arch), tmp_path / "m.gguf", "Q8_0", **change)
    with pytest.raises(ModelFilesError, match=problem) as info:
        _convert(path)
    assert "\n" not in str(info.value)


def test_each_expert_is_its_slice_of_the_stack(tiny_hf: Callable[[str], Path], tmp_path: Path) -> None:
    """Expert e of layer l is row e of the layer's stacked tensors, in Hugging Face layout; a
    stack's first dimension is the expert (GGUF's last)."""
    gguf_file = write_gguf(tiny_hf("mixtral"), tmp_path / "m.gguf")
    reader = open_reader(gguf_file)
    stacked = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert stacked.shape.tolist() == [64, 64, 4]  # GGUF: in (the expert width), out (hidden), experts
    converted = _convert(gguf_file)
    np.testing.assert_array_equal(converted["model.layers.1.block_sparse_moe.experts.2.w2.weight"], stacked.data[2])
    source = load_file(str(tiny_hf("mixtral") / "model.safetensors"))
    for name in ("model.layers.1.block_sparse_moe.experts.2.w2.weight", "model.layers.0.block_sparse_moe.gate.weight"):
        np.testing.assert_array_equal(converted[name], source[name])


def test_dequantizable_holds_the_asked_for_types() -> None:
    names = {t.name for t in weights.dequantizable()}
    assert {
        "F32",
        "F16",
        "BF16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    } <= names
    assert "I8" not in names


def test_the_written_file_holds_every_tensor_as_the_converter_yields_it(hf_folder: Path, tmp_path: Path) -> None:
    """``write`` builds the safetensors header itself: the library reads the file back whole."""
    gguf_file = write_gguf(hf_folder, tmp_path / "m.gguf", "Q8_0")
    reader = open_reader(gguf_file)
    config = metadata.hf_config(reader, gguf_file)
    weights.write(reader, config, tmp_path / "model.safetensors", gguf_file)
    written = load_file(str(tmp_path / "model.safetensors"))
    expected = _convert(gguf_file)
    assert sorted(written) == sorted(expected)
    for name, array in expected.items():
        assert written[name].dtype == np.float32
        np.testing.assert_array_equal(written[name], array, err_msg=name)
    assert (tmp_path / "model.safetensors").stat().st_size == len(
        weights.safetensors_header({name: a.shape for name, a in expected.items()})
    ) + weights.float32_bytes(reader, config, gguf_file)


def test_conversion_holds_one_dequantized_tensor_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q8_0 (or 1.5-bit) file grows 4 (20) times dequantized: the converter held the whole
    float32 model before writing it. tracemalloc counts numpy's allocations exactly (no timing,
    no RSS): the most ``write`` holds at once must be a few copies of the largest tensor, far
    below the model's 20."""
    hf = make_tiny_model(tmp_path / "hf", "llama", seed=3, hidden=64, layers=8)
    gguf_file = write_gguf(hf, tmp_path / "m.gguf", "Q8_0")
    peaks: list[int] = []
    real = weights.write

    def measured(reader: Any, config: dict[str, Any], path: Path, where: Path | str) -> None:
        tracemalloc.start()
        try:
            real(reader, config, path, where)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()

    monkeypatch.setattr(weights, "write", measured)
    folder = prepare(gguf_file, tmp_path / "cache")
    sizes = [array.nbytes for array in load_file(str(folder / "model.safetensors")).values()]
    assert len(sizes) > 40 and sum(sizes) > 15 * max(sizes)
    # dequantize's own temporaries, the unpermuted copy: under 4 copies measured; the old peak was 21
    assert peaks[0] <= 6 * max(sizes), (peaks, max(sizes), sum(sizes))


def test_each_expert_is_dequantized_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real stack is gigabytes in float32 (Mixtral 8x7B: 8 x 14336 x 4096 per projection):
    ``dequantize`` is given one expert's quantized rows at a time, never the stack, here 32
    experts whose stack is 8 times the largest tensor the folder holds."""
    hf = make_tiny_model(tmp_path / "hf", "mixtral", seed=3, keys={"num_local_experts": 32}, hidden=64, layers=2)
    gguf_file = write_gguf(hf, tmp_path / "m.gguf", "Q8_0")
    sizes: list[int] = []
    real = weights.dequantize

    def measured(data: np.ndarray, qtype: Any) -> np.ndarray:
        array = real(data, qtype)
        sizes.append(array.nbytes)
        return array

    weights.dequantizable()  # its probes (cached) are not the conversion's
    monkeypatch.setattr(weights, "dequantize", measured)
    converted = _convert(gguf_file)
    assert len(sizes) == len(converted) and max(sizes) == max(a.nbytes for a in converted.values()) == 259 * 64 * 4
    stack = next(t for t in open_reader(gguf_file).tensors if t.name == "blk.0.ffn_up_exps.weight")
    assert int(stack.n_elements) * 4 == 32 * 64 * 64 * 4 > 7 * max(sizes)


def test_a_file_claiming_a_million_experts_it_lacks_fails_before_they_are_listed(tmp_path: Path) -> None:
    """1024 layers of 1024 experts, within every bound, and no tensors: listing each expert's
    three Hugging Face names first held 1.6 GB (measured here); the stacks are checked first, so the
    most the check holds (tracemalloc: numpy's and Python's allocations, exactly) stays small."""
    path = tmp_path / "m.gguf"
    writer = GGUFWriter(path, "llama")
    for key, value in {
        "block_count": 1024,
        "embedding_length": 64,
        "feed_forward_length": 64,
        "context_length": 64,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    for key, value in {
        "attention.head_count": 4,
        "vocab_size": 300,
        "expert_count": 1024,
        "expert_used_count": 2,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    reader = open_reader(path)
    config = metadata.hf_config(reader, path)
    assert (config["num_hidden_layers"], config["num_local_experts"]) == (1024, 1024)
    tracemalloc.start()
    try:
        with pytest.raises(ModelFilesError, match=r"missing tensor token_embd\.weight .*\(and \d+ more\)"):
            weights.plan(reader, config, path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
