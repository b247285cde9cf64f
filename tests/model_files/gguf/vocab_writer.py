"""Writes a Hugging Face tokenizer into a GGUF file's metadata the way llama.cpp's convert_hf_to_gguf.py does, so
tests can build GGUF files from tokenizers they know (``get_vocab_base`` and ``gguf.SpecialVocab``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer


def add_vocab(writer: gguf.GGUFWriter, hf_folder: Path, pre: str | None = None) -> None:
    """Add the tokenizer of ``hf_folder`` (tokenizer.json, tokenizer_config.json, config.json if there):
    model "gpt2", ``pre`` (inferred from the pre-tokenizer when None), tokens and token types, then merges,
    special ids, add_bos/add_eos and the chat template through the gguf package's own ``SpecialVocab``."""
    tokenizer = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    raw = json.loads((hf_folder / "tokenizer.json").read_text())
    tokens, types = vocab_base(tokenizer, _vocab_size(hf_folder, tokenizer))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or infer_pre(raw))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _vocab_size(hf_folder: Path, tokenizer: Tokenizer) -> int:
    # convert_hf_to_gguf.py takes config.json's vocab_size (the embedding's rows) and pads the token list to it.
    config_file = hf_folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return int(config.get("vocab_size") or tokenizer.get_vocab_size(with_added_tokens=True))


def vocab_base(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens and types by id, as convert_hf_to_gguf.py's ``get_vocab_base``: ids without a token are
    ``[PAD<id>]`` (UNUSED); added tokens are CONTROL when special or when they look special, else USER_DEFINED."""
    by_id = {i: token for token, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    added = tokenizer.get_added_tokens_decoder()
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            special = added[i].special or _looks_special(added[i].content)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _looks_special(text: str) -> bool:
    # The converter's does_token_look_special, for the shapes these tests use.
    return text.startswith("<|") and text.endswith("|>")


def infer_pre(tokenizer_json: dict[str, Any]) -> str:
    """The ``tokenizer.ggml.pre`` name for a tokenizer.json's pre-tokenizer. The converter recognises models by a
    hash of their encodings of a fixed text; these tests know only a few shapes, so they look at the shape."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre])
    kinds = [part.get("type") for part in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"]:
        pattern = parts[0]["pattern"].get("Regex", "")
        if r"\p{N}{1,3}" in pattern:
            return "llama-bpe"
        if r"|\p{N}|" in pattern:
            return "qwen2"
    raise ValueError(f"no tokenizer.ggml.pre known for the pre-tokenizer {kinds}")
