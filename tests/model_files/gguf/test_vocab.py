"""The tokenizer rebuilt from a GGUF file's metadata encodes as the Hugging Face tokenizer it was converted from,
decodes back to the text, treats special tokens as the original does, and bad metadata fails naming the key."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from splitbus.env import load_env
from splitbus.model_files.fetch import SOURCES, fetched_path
from splitbus.model_files.gguf.vocab import LLAMA3_PATTERN, PRE_TOKENIZERS, QWEN2_PATTERN, read_vocab, tokenizer_files
from splitbus.tokenization import ModelFilesError, ModelTokenizer
from splitbus.tokenization.byte_level import CHATML_TEMPLATE, write_byte_level_tokenizer
from tests.model_files.gguf.vocab_writer import add_vocab

TEXTS = (
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159 and 1234567 is big.",
    "   leading spaces, and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n  indented\n\n\n",
    "naïve café, Ünïcödé: 你好，世界 — ok",
    "emoji 🤖🚀 and a ZWJ sequence 👩‍💻!",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n",
    "don't, I'll, we've, SHE'S, they'RE",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
)
CORPUS = [
    *TEXTS,
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.",
    "In 1999 there were 12 months, 52 weeks and 365 days, as in 2023.",
    "for i in range(10):\n    print(i, i * i)\n\nif __name__ == '__main__':\n    main()\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "We're here, you're there, it's fine and I'd say they'll come.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The real model, where `splitbus fetch-model smollm2` puts it (SPLITBUS_DATA_DIR, else .splitbus where pytest runs).
SMOLLM2_GGUF = fetched_path(SOURCES["smollm2"], load_env().data_dir / "models")


# ---- Hugging Face tokenizers to convert


def _trained(
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    normalizer: normalizers.Normalizer | None = None,
    specials: list[str] = SPECIALS,
) -> Tokenizer:
    """A small byte-level BPE trained on CORPUS, as a real model's tokenizer is trained on its corpus."""
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return tokenizer


def _smollm_like() -> Tokenizer:
    # SmolLM2's tokenizer.json: Digits(individual_digits) then ByteLevel with GPT-2's regex.
    return _trained(
        pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    )


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _qwen2_like() -> Tokenizer:
    # Qwen2's: NFC, its Split regex, ByteLevel without regex; plus a non-special added token, as Qwen2.5 has.
    tokenizer = _trained(_split_then_bytes(QWEN2_PATTERN), normalizers.NFC())
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    return tokenizer


def _llama3_like() -> Tokenizer:
    # Llama 3's: its Split regex, ignore_merges, and a post-processor that prepends BOS.
    specials = ["<|begin_of_text|>", "<|end_of_text|>", *SPECIALS[1:]]
    tokenizer = _trained(_split_then_bytes(LLAMA3_PATTERN), specials=specials)
    tokenizer.model.ignore_merges = True
    bos = "<|begin_of_text|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    return tokenizer


def _save(tokenizer: Tokenizer, folder: Path, bos: str | None, config: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    tok_config = {"bos_token": bos, "eos_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _tiny(root: Path) -> Path:
    folder = root / "tiny"
    write_byte_level_tokenizer(folder)
    return folder


def _smollm(root: Path) -> Path:
    return _save(_smollm_like(), root / "smollm", bos="<|im_start|>")


def _qwen2(root: Path) -> Path:
    tokenizer = _qwen2_like()
    # Qwen2's embedding has more rows than its tokenizer has tokens: the converter pads with [PAD<id>].
    padded = {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True) + 3}
    return _save(tokenizer, root / "qwen2", bos=None, config=padded)


def _llama3(root: Path) -> Path:
    return _save(_llama3_like(), root / "llama3", bos="<|begin_of_text|>")


ORIGINALS: dict[str, Callable[[Path], Path]] = {"tiny": _tiny, "smollm": _smollm, "qwen2": _qwen2, "llama3": _llama3}
PRE = {"tiny": "gpt-2", "smollm": "smollm", "qwen2": "qwen2", "llama3": "llama-bpe"}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: make(root) for name, make in ORIGINALS.items()}


# ---- GGUF files


Edit = Callable[[dict[str, gguf.GGUFValue]], None]


def write_gguf(path: Path, hf_folder: Path, edit: Edit | None = None) -> Path:
    """A GGUF file with no tensors and ``hf_folder``'s tokenizer; ``edit`` changes the metadata first."""
    writer = gguf.GGUFWriter(path, "llama")
    add_vocab(writer, hf_folder)
    if edit is not None:
        edit(writer.kv_data[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_files(gguf.GGUFReader(path))["tokenizer.json"])


@pytest.fixture(scope="module")
def converted(hf_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("gguf")
    return {name: gguf_tokenizer(write_gguf(root / f"{name}.gguf", folder)) for name, folder in hf_folders.items()}


@pytest.mark.parametrize("name", sorted(ORIGINALS))
def test_the_converter_names_the_pre_tokenizer(name: str, hf_folders: dict[str, Path], tmp_path: Path) -> None:
    vocab = read_vocab(gguf.GGUFReader(write_gguf(tmp_path / "t.gguf", hf_folders[name])))
    assert vocab.pre == PRE[name]


@pytest.mark.parametrize("name", sorted(ORIGINALS))
def test_decode_returns_the_text(name: str, converted: dict[str, Tokenizer]) -> None:
    tokenizer = converted[name]
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("name", sorted(ORIGINALS))
def test_same_ids_as_the_original(name: str, hf_folders: dict[str, Path], converted: dict[str, Tokenizer]) -> None:
    original = Tokenizer.from_file(str(hf_folders[name] / "tokenizer.json"))
    for text in (*TEXTS, "cafe\u0301 vs café", "x" * 40 + " 0123456789"):
        for add_special in (False, True):
            expected = original.encode(text, add_special_tokens=add_special).ids
            assert converted[name].encode(text, add_special_tokens=add_special).ids == expected, (text, add_special)


@pytest.mark.parametrize(("name", "other"), [("smollm", "qwen2"), ("qwen2", "smollm"), ("llama3", "qwen2")])
def test_the_pre_tokenizer_decides_the_ids(name: str, other: str, hf_folders: dict[str, Path], tmp_path: Path) -> None:
    """The same vocabulary read with another ``tokenizer.ggml.pre`` splits some texts differently: the registry's
    choice is what makes the ids agree with the original's."""
    original = Tokenizer.from_file(str(hf_folders[name] / "tokenizer.json"))
    misread = gguf_tokenizer(write_gguf(tmp_path / "t.gguf", hf_folders[name], _set(T.PRE, other, STRING)))
    changed = [t for t in CORPUS if misread.encode(t).ids != original.encode(t, add_special_tokens=False).ids]
    assert changed


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_is_lossless(pre: str, hf_folders: dict[str, Path], tmp_path: Path) -> None:
    tokenizer = gguf_tokenizer(write_gguf(tmp_path / "t.gguf", hf_folders["smollm"], _set(T.PRE, pre, STRING)))
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_smollm_splits_digits_one_by_one(converted: dict[str, Tokenizer]) -> None:
    tokenizer = converted["smollm"]
    pieces = [tokenizer.id_to_token(i) for i in tokenizer.encode("year 2024", add_special_tokens=False).ids]
    assert pieces[-4:] == ["2", "0", "2", "4"]


# Spelled as llama.cpp's src/llama-vocab.cpp spells them (no inline flags in its regex engine).
LLAMA_CPP_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA_CPP_LLAMA3 = LLAMA_CPP_QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


@pytest.mark.parametrize(("ours", "llama_cpp"), [(QWEN2_PATTERN, LLAMA_CPP_QWEN2), (LLAMA3_PATTERN, LLAMA_CPP_LLAMA3)])
def test_regexes_split_as_llama_cpp_does(ours: str, llama_cpp: str) -> None:
    pieces = [_split_then_bytes(pattern).pre_tokenize_str for pattern in (ours, llama_cpp)]
    for text in TEXTS:
        assert pieces[0](text) == pieces[1](text), text


@pytest.mark.parametrize("name", ["smollm", "qwen2"])
def test_special_tokens_are_one_id_and_skipped(name: str, converted: dict[str, Tokenizer]) -> None:
    tokenizer = converted[name]
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    assert start is not None and end is not None
    ids = tokenizer.encode("<|im_start|>user\nHi there<|im_end|>\n", add_special_tokens=False).ids
    assert ids[0] == start and ids.count(start) == 1 and ids.count(end) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi there\n"


def test_user_defined_tokens_are_matched_and_kept_by_decode(converted: dict[str, Tokenizer]) -> None:
    tokenizer = converted["qwen2"]
    think = tokenizer.token_to_id("<think>")
    ids = tokenizer.encode("a<think>b", add_special_tokens=False).ids
    assert think in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<think>b"


def test_unused_ids_keep_their_place(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    vocab = read_vocab(gguf.GGUFReader(write_gguf(tmp_path / "q.gguf", hf_folders["qwen2"])))
    assert vocab.tokens[-1] == f"[PAD{len(vocab.tokens) - 1}]"
    assert vocab.token_types[-1] == gguf.TokenType.UNUSED


def test_the_folder_loads_as_a_model_tokenizer(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    """What the API and workers see: tokenizer_config.json's template, EOS and BOS texts, ids from config.json."""
    reader = gguf.GGUFReader(write_gguf(tmp_path / "s.gguf", hf_folders["smollm"]))
    vocab = read_vocab(reader)
    folder = tmp_path / "folder"
    folder.mkdir()
    for name, text in tokenizer_files(reader).items():
        (folder / name).write_text(text)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": list(vocab.end_ids)}))
    model = ModelTokenizer.load(folder, "s")
    end = vocab.tokens.index("<|im_end|>")
    assert (model.eos_token, model.bos_token, model.eos_token_ids) == ("<|im_end|>", "<|im_start|>", (end,))
    assert model.has_own_chat_template and model.chat_template == CHATML_TEMPLATE
    prompt = model.render_chat([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert model.decode(model.encode(prompt)) == "user\nHi\nassistant\n"


def _set(key: str, value: Any, vtype: gguf.GGUFValueType, sub: gguf.GGUFValueType | None = None) -> Edit:
    def edit(kv: dict[str, gguf.GGUFValue]) -> None:
        kv[key] = gguf.GGUFValue(value, vtype, sub)

    return edit


def _drop(key: str) -> Edit:
    def edit(kv: dict[str, gguf.GGUFValue]) -> None:
        del kv[key]

    return edit


def _token_list(change: Callable[[list[str]], list[str]]) -> Edit:
    def edit(kv: dict[str, gguf.GGUFValue]) -> None:
        kv[gguf.Keys.Tokenizer.LIST] = gguf.GGUFValue(change(list(kv[gguf.Keys.Tokenizer.LIST].value)), ARRAY)

    return edit


T = gguf.Keys.Tokenizer
ARRAY, STRING, UINT32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32
BAD = {
    "unknown pre": (_set(T.PRE, "nonesuch", STRING), T.PRE, "'nonesuch'"),
    "sentencepiece model": (_set(T.MODEL, "llama", STRING), T.MODEL, "'llama'"),
    "no model": (_drop(T.MODEL), T.MODEL, "missing"),
    "no tokens": (_drop(T.LIST), T.LIST, "missing"),
    "fewer types than tokens": (_set(T.TOKEN_TYPE, [1, 1, 3], ARRAY), T.TOKEN_TYPE, "3 entries"),
    "unknown token type": (_set(T.TOKEN_TYPE, [1] * 258 + [9], ARRAY), T.TOKEN_TYPE, "type 9"),
    "eos out of range": (_set(T.EOS_ID, 100000, UINT32), T.EOS_ID, "100000"),
    "id of the wrong type": (_set(T.BOS_ID, "1", STRING), T.BOS_ID, "must be an integer"),
    "types of the wrong type": (_set(T.TOKEN_TYPE, ["1"], ARRAY), T.TOKEN_TYPE, "array of INT32"),
    "merge into an unknown token": (_set(T.MERGES, ["Ġ t"], ARRAY), T.MERGES, "entry 0 ('Ġ t') needs 'Ġt'"),
    "merge without a space": (_set(T.MERGES, ["ab"], ARRAY), T.MERGES, "entry 0 ('ab') is not two"),
    "duplicate token": (_token_list(lambda t: [*t[:-1], t[0]]), T.LIST, "twice"),
    "bos asked for, none given": (_set(T.ADD_BOS, True, gguf.GGUFValueType.BOOL), T.ADD_BOS, "no BOS id"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_metadata_fails_naming_the_key(case: str, hf_folders: dict[str, Path], tmp_path: Path) -> None:
    edit, key, detail = BAD[case]
    path = write_gguf(tmp_path / "bad.gguf", hf_folders["tiny"], edit)
    with pytest.raises(ModelFilesError, match=re.escape(key)) as failure:
        tokenizer_files(gguf.GGUFReader(path))
    assert str(path) in str(failure.value) and detail in str(failure.value)


# ---- the real SmolLM2 file (fetched by `splitbus fetch-model smollm2`; CI fetches it)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    if not SMOLLM2_GGUF.is_file():
        pytest.skip(f"{SMOLLM2_GGUF} is absent: `splitbus fetch-model smollm2` puts it there")
    folder = tmp_path_factory.mktemp("smollm2")
    files = tokenizer_files(gguf.GGUFReader(SMOLLM2_GGUF))
    for name, text in {**files, "config.json": json.dumps({"eos_token_id": 2})}.items():
        (folder / name).write_text(text)
    return ModelTokenizer.load(folder, "smollm2")


# SmolLM2's ids for these texts (Hugging Face's tokenizer gives the same); digits come one per token.
SMOLLM2_IDS = {
    "What is the capital of France?": [1780, 314, 260, 3575, 282, 4649, 47],
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
    "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
    "  multiple   spaces": [216, 2701, 256, 5600],
}


def test_smollm2_ids(smollm2: ModelTokenizer) -> None:
    assert {text: smollm2.encode(text) for text in SMOLLM2_IDS} == SMOLLM2_IDS
    assert all(smollm2.decode(ids) == text for text, ids in SMOLLM2_IDS.items())


def test_smollm2_chatml_renders_to_its_special_ids(smollm2: ModelTokenizer) -> None:
    ids = smollm2.encode(smollm2.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    system = [2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182]
    question = SMOLLM2_IDS["What is the capital of France?"]
    # <|im_start|>=1 system \n <default system prompt> <|im_end|>=2 \n, then the user turn, then assistant's start.
    assert ids == [1, 9690, 198, *system, 2, 198, 1, 4093, 198, *question, 2, 198, 1, 520, 9531, 198]
    assert (smollm2.bos_token, smollm2.eos_token, smollm2.eos_token_ids) == ("<|im_start|>", "<|im_end|>", (2,))
