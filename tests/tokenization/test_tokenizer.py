"""Which ids end generation, and the special tokens a folder's config files set."""

from __future__ import annotations

import pytest
from tokenizers import processors

from splitbus.tokenization import ModelFilesError, ModelTokenizer
from tests.tokenization.conftest import FolderMaker

ENDOFTEXT, IM_START, IM_END = 256, 257, 258


def test_chatml_eos_token_joins_a_different_config_eos(model_folder: FolderMaker) -> None:
    # SmolLM2-style: config.json ends on <|endoftext|>, a chat turn ends on <|im_end|>
    folder = model_folder({"eos_token": "<|im_end|>"}, {"eos_token_id": ENDOFTEXT})
    tok = ModelTokenizer.load(folder)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == (ENDOFTEXT, IM_END)


def test_generation_config_list_is_read_instead_of_config(model_folder: FolderMaker) -> None:
    files = {"generation_config.json": {"eos_token_id": [ENDOFTEXT, IM_START], "do_sample": True}}
    folder = model_folder({"eos_token": {"content": "<|im_end|>", "special": True}}, {"eos_token_id": 5}, files)
    assert ModelTokenizer.load(folder).eos_token_ids == (ENDOFTEXT, IM_START, IM_END)


def test_generation_config_with_one_id_or_none(model_folder: FolderMaker) -> None:
    one = model_folder({"eos_token": "<|im_end|>"}, {}, {"generation_config.json": {"eos_token_id": IM_END}})
    assert ModelTokenizer.load(one).eos_token_ids == (IM_END,)
    none = model_folder({}, {"eos_token_id": ENDOFTEXT}, {"generation_config.json": {"bos_token_id": 1}})
    assert ModelTokenizer.load(none).eos_token_ids == ()


@pytest.mark.parametrize("value", ["2", True, [1, "2"], [-1], 2**40, {"id": 2}])
def test_a_bad_eos_id_names_its_file(model_folder: FolderMaker, value: object) -> None:
    folder = model_folder({}, {}, {"generation_config.json": {"eos_token_id": value}})
    with pytest.raises(ModelFilesError, match="generation_config.json: eos_token_id must be"):
        ModelTokenizer.load(folder)


def test_unreadable_generation_config_is_a_model_files_error(model_folder: FolderMaker) -> None:
    with pytest.raises(ModelFilesError, match="generation_config.json is not valid JSON"):
        ModelTokenizer.load(model_folder({}, {}, {"generation_config.json": "{"}))


def test_an_eos_token_outside_the_vocabulary_adds_no_id(model_folder: FolderMaker) -> None:
    folder = model_folder({"eos_token": "</s>"}, {"eos_token_id": ENDOFTEXT})
    assert ModelTokenizer.load(folder).eos_token_ids == (ENDOFTEXT,)


def test_special_tokens_map_fills_in_what_tokenizer_config_lacks(model_folder: FolderMaker) -> None:
    token_map = {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>", "unk_token": {"content": "<unk>"}}
    folder = model_folder({"eos_token": "<|im_end|>"}, {}, {"special_tokens_map.json": token_map})
    tok = ModelTokenizer.load(folder)
    assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    assert tok.bos_token == "<|im_start|>" and tok.eos_token_ids == (IM_END,)


def test_decode_skips_special_tokens_unless_told(model_folder: FolderMaker) -> None:
    tok = ModelTokenizer.load(model_folder())
    ids = [IM_START, *tok.encode("hi"), IM_END]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tok.added_tokens == {ENDOFTEXT: "<|endoftext|>", IM_START: "<|im_start|>", IM_END: "<|im_end|>"}


def test_special_tokens_are_added_only_when_asked(model_folder: FolderMaker) -> None:
    tok = ModelTokenizer.load(model_folder())
    # A Llama-style post-processor that starts every text with a BOS (here <|endoftext|>).
    tok.tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", ENDOFTEXT)]
    )
    plain = tok.encode("ab")
    assert tok.encode_batch(["ab"]) == [plain] and ENDOFTEXT not in plain
    assert tok.encode_batch(["ab"], add_special_tokens=True) == [[ENDOFTEXT, *plain]]
