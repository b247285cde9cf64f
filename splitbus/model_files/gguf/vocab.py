"""The tokenizer of a GGUF file, rebuilt as Hugging Face ``tokenizer.json`` and ``tokenizer_config.json``.

llama.cpp's converter (``convert_hf_to_gguf.py``) flattens a Hugging Face byte-level BPE tokenizer into metadata:
the tokens, one type per token, the merges, the special-token ids and flags, the chat template, and the *name* of
the pre-tokenizer (``tokenizer.ggml.pre``), whose regexes llama.cpp keeps in its own source (``src/llama-vocab.cpp``).
:func:`tokenizer_files` reads and checks those fields (a file's metadata may lie) and builds the same tokenizer with
the ``tokenizers`` library's own BPE model, pre-tokenizers and byte-level decoder, so that everything downstream
loads it as it loads a Hugging Face folder.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from splitbus.tokenization import ModelFilesError

logger = logging.getLogger(__name__)

KEYS = gguf.Keys.Tokenizer
MAX_TOKENS = 1 << 21
"""The most tokens (and merges) a vocabulary may hold; the largest in use have about 260k."""

# The Hugging Face originals' regexes. llama.cpp's copies spell the contractions (?:'[sS]|'[tT]|...) because its
# regex engine has no inline flags; tokenizers' engine (Oniguruma) has them, so the originals are kept.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
DEFAULT_PATTERNS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
"""llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_DEFAULT``: applied one after another, each splitting what the last left."""


def _gpt2() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's own regex is GPT-2's: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's SMOLLM/STARCODER: "\p{N}" (each digit alone), then GPT-2's regex.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _splits_then_bytes(*patterns: str) -> pre_tokenizers.PreTokenizer:
    # Like llama.cpp's unicode_regex_split: every regex keeps both its matches and the text between them.
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in patterns]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How one ``tokenizer.ggml.pre`` value splits text before BPE (llama.cpp's ``llm_tokenizer_bpe``)."""

    build: Callable[[], pre_tokenizers.PreTokenizer]
    """The pre-tokenizer, ending in the byte-level mapping every GPT-2-style vocabulary is written in."""
    normalizer: Callable[[], normalizers.Normalizer] | None = None
    """Applied before splitting: Qwen2's Hugging Face tokenizer composes to NFC (llama.cpp skips it)."""
    ignore_merges: bool = False
    """A word that is in the vocabulary is one token whatever the merges say (llama.cpp's ``ignore_merges``)."""
    add_bos: bool = False
    """Whether BOS is prepended when the file has no ``tokenizer.ggml.add_bos_token`` (llama.cpp's default)."""
    clean_spaces: bool = True
    """``clean_up_tokenization_spaces`` in tokenizer_config.json (llama.cpp's ``clean_spaces``)."""


_GPT2 = PreTokenizerSpec(_gpt2)
_QWEN2 = PreTokenizerSpec(
    functools.partial(_splits_then_bytes, QWEN2_PATTERN), normalizer=normalizers.NFC, clean_spaces=False
)
_LLAMA3 = PreTokenizerSpec(functools.partial(_splits_then_bytes, LLAMA3_PATTERN), ignore_merges=True, add_bos=True)

PRE_TOKENIZERS: Mapping[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec(functools.partial(_splits_then_bytes, *DEFAULT_PATTERNS)),
    "gpt-2": _GPT2,
    "smollm": PreTokenizerSpec(_digits_then_gpt2, clean_spaces=False),
    "starcoder": PreTokenizerSpec(_digits_then_gpt2),
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
}
"""``tokenizer.ggml.pre`` values this module can rebuild, with llama.cpp's names (src/llama-vocab.cpp)."""


@dataclass(frozen=True)
class GGUFVocab:
    """A GGUF file's tokenizer metadata, checked: every id is in range, every merge joins two tokens."""

    tokens: tuple[str, ...]
    """Token text by id, in the byte-level alphabet (``Ġ`` for a space); added tokens as they are written."""
    token_types: tuple[int, ...]
    """``gguf.TokenType`` by id (0 where llama.cpp has UNDEFINED)."""
    merges: tuple[tuple[str, str], ...]
    """The BPE merges, highest priority first."""
    pre: str
    """The ``tokenizer.ggml.pre`` value, a key of :data:`PRE_TOKENIZERS`."""
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    """Whether encoding with special tokens prepends BOS."""
    add_eos: bool
    """Whether encoding with special tokens appends EOS."""
    chat_template: str | None

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The ids that end generation: EOS, then end-of-turn and end-of-message where the file names them."""
        ids = (self.eos_id, self.eot_id, self.eom_id)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def tokenizer_files(reader: gguf.GGUFReader) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` (file name -> JSON text) for the file ``reader`` reads.

    Raises ModelFilesError naming the file and the key when the metadata is missing, of the wrong type, out of
    range, or describes a tokenizer other than byte-level BPE with a known pre-tokenizer."""
    return vocab_files(read_vocab(reader), _source(reader))


def vocab_files(vocab: GGUFVocab, source: str) -> dict[str, str]:
    """As :func:`tokenizer_files`, from a vocabulary already read; ``source`` names the file in errors."""
    return {
        "tokenizer.json": build_tokenizer(vocab, source).to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config(vocab), indent=2, ensure_ascii=False) + "\n",
    }


# ---- reading and checking the metadata


def _source(reader: gguf.GGUFReader) -> str:
    """The file's path for messages (np.memmap keeps it)."""
    return str(getattr(reader.data, "filename", None) or "GGUF file")


_ARRAY = gguf.GGUFValueType.ARRAY
_INTEGER_TYPES = frozenset(
    {
        gguf.GGUFValueType.UINT8,
        gguf.GGUFValueType.INT8,
        gguf.GGUFValueType.UINT16,
        gguf.GGUFValueType.INT16,
        gguf.GGUFValueType.UINT32,
        gguf.GGUFValueType.INT32,
        gguf.GGUFValueType.UINT64,
        gguf.GGUFValueType.INT64,
    }
)
_TOKEN_TYPES = range(0, max(gguf.TokenType) + 1)
_SPECIAL_TYPES = frozenset({gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN})
"""Added tokens that are special: matched in text, skipped by decode(skip_special_tokens=True)."""


@dataclass(frozen=True)
class _Fields:
    """Typed access to a reader's fields: a wrong type raises ModelFilesError naming the key."""

    fields: Mapping[str, gguf.ReaderField]
    source: str

    def error(self, key: str, problem: str) -> ModelFilesError:
        return ModelFilesError(f"{self.source}: {key} {problem}")

    def _field(self, key: str, kind: str, ok: Callable[[list[gguf.GGUFValueType]], bool]) -> gguf.ReaderField | None:
        field = self.fields.get(key)
        if field is not None and not ok(list(field.types)):
            raise self.error(key, f"must be {kind}, not {'/'.join(t.name for t in field.types)}")
        return field

    def _array(self, key: str, item: gguf.GGUFValueType) -> gguf.ReaderField | None:
        # An empty array has no item type in the reader's view: types is [ARRAY] alone.
        field = self._field(key, f"an array of {item.name}", lambda t: t in ([_ARRAY], [_ARRAY, item]))
        if field is not None and len(field.data) > MAX_TOKENS:
            raise self.error(key, f"has {len(field.data)} entries, more than {MAX_TOKENS}")
        return field

    def string(self, key: str) -> str | None:
        field = self._field(key, "a string", lambda t: t == [gguf.GGUFValueType.STRING])
        return None if field is None else self._decode(key, field.parts[field.data[0]])

    def strings(self, key: str) -> list[str] | None:
        field = self._array(key, gguf.GGUFValueType.STRING)
        return None if field is None else [self._decode(key, field.parts[i]) for i in field.data]

    def integers(self, key: str) -> list[int] | None:
        field = self._array(key, gguf.GGUFValueType.INT32)
        return None if field is None else [int(field.parts[i][0]) for i in field.data]

    def integer(self, key: str) -> int | None:
        field = self._field(key, "an integer", lambda t: len(t) == 1 and t[0] in _INTEGER_TYPES)
        return None if field is None else int(field.parts[field.data[0]][0])

    def boolean(self, key: str) -> bool | None:
        field = self._field(key, "a bool", lambda t: t == [gguf.GGUFValueType.BOOL])
        return None if field is None else bool(field.parts[field.data[0]][0])

    def _decode(self, key: str, part: Any) -> str:
        try:
            return part.tobytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(key, f"holds text that is not UTF-8 ({exc.reason} at byte {exc.start})") from None


def read_vocab(reader: gguf.GGUFReader) -> GGUFVocab:
    """The checked tokenizer metadata of the file ``reader`` reads (see :func:`tokenizer_files`)."""
    fields = _Fields(reader.fields, _source(reader))
    pre = _pre(fields)
    tokens = _tokens(fields)
    n_tokens = len(tokens)
    add_bos, add_eos = fields.boolean(KEYS.ADD_BOS), fields.boolean(KEYS.ADD_EOS)
    vocab = GGUFVocab(
        tokens=tokens,
        token_types=_token_types(fields, n_tokens),
        merges=_merges(fields, tokens),
        pre=pre,
        bos_id=_token_id(fields, KEYS.BOS_ID, n_tokens),
        eos_id=_token_id(fields, KEYS.EOS_ID, n_tokens),
        eot_id=_token_id(fields, KEYS.EOT_ID, n_tokens),
        eom_id=_token_id(fields, KEYS.EOM_ID, n_tokens),
        pad_id=_token_id(fields, KEYS.PAD_ID, n_tokens),
        unk_id=_token_id(fields, KEYS.UNK_ID, n_tokens),
        add_bos=PRE_TOKENIZERS[pre].add_bos if add_bos is None else add_bos,
        add_eos=bool(add_eos),
        chat_template=fields.string(KEYS.CHAT_TEMPLATE),
    )
    _check_flags(fields, vocab)
    return vocab


def _pre(fields: _Fields) -> str:
    model = fields.string(KEYS.MODEL)
    if model is None:
        raise fields.error(KEYS.MODEL, "is missing")
    if model != "gpt2":
        raise fields.error(KEYS.MODEL, f"is {model!r}: only 'gpt2' (byte-level BPE) tokenizers are supported")
    pre = fields.string(KEYS.PRE)
    if pre is None:
        logger.warning("%s has no %s: using llama.cpp's 'default' pre-tokenizer", fields.source, KEYS.PRE)
        return "default"
    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise fields.error(KEYS.PRE, f"is {pre!r}, a pre-tokenizer this converter does not know (known: {known})")
    return pre


def _tokens(fields: _Fields) -> tuple[str, ...]:
    tokens = fields.strings(KEYS.LIST)
    if not tokens:
        raise fields.error(KEYS.LIST, "is missing or empty")
    # As llama.cpp does: an empty token cannot be matched, but its id must stay taken.
    tokens = [token or f"[EMPTY_{i}]" for i, token in enumerate(tokens)]
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if seen.setdefault(token, i) != i:
            raise fields.error(KEYS.LIST, f"holds {token!r} twice (ids {seen[token]} and {i})")
    return tuple(tokens)


def _token_types(fields: _Fields, n_tokens: int) -> tuple[int, ...]:
    types = fields.integers(KEYS.TOKEN_TYPE)
    if types is None:
        return (gguf.TokenType.NORMAL,) * n_tokens
    if len(types) != n_tokens:
        raise fields.error(KEYS.TOKEN_TYPE, f"has {len(types)} entries for {n_tokens} tokens")
    bad = next((i for i, t in enumerate(types) if t not in _TOKEN_TYPES), None)
    if bad is not None:
        raise fields.error(KEYS.TOKEN_TYPE, f"gives token {bad} the type {types[bad]}, not a gguf.TokenType")
    return tuple(types)


def _merges(fields: _Fields, tokens: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    # No key means no merges: the gguf writer cannot store an empty array, so a byte-level vocabulary without
    # merges (the tiny test models') has none. llama.cpp refuses such a file; every token is still reachable here.
    merges = fields.strings(KEYS.MERGES) or []
    ids = {token: i for i, token in enumerate(tokens)}
    pairs = []
    for index, merge in enumerate(merges):
        # llama.cpp splits at the first space after the first character (a part may be a lone space).
        cut = merge.find(" ", 1)
        if cut < 0:
            raise fields.error(KEYS.MERGES, f"entry {index} ({merge!r}) is not two tokens joined by a space")
        left, right = merge[:cut], merge[cut + 1 :]
        missing = next((t for t in (left, right, left + right) if t not in ids), None)
        if missing is not None:
            raise fields.error(KEYS.MERGES, f"entry {index} ({merge!r}) needs {missing!r}, which is not a token")
        pairs.append((left, right))
    return tuple(pairs)


def _token_id(fields: _Fields, key: str, n_tokens: int) -> int | None:
    token_id = fields.integer(key)
    if token_id is not None and not 0 <= token_id < n_tokens:
        raise fields.error(key, f"is {token_id}, outside the vocabulary of {n_tokens} tokens")
    return token_id


def _check_flags(fields: _Fields, vocab: GGUFVocab) -> None:
    if vocab.add_bos and vocab.bos_id is None:
        raise fields.error(KEYS.ADD_BOS, f"is true (or implied by pre-tokenizer {vocab.pre!r}) but there is no BOS id")
    if vocab.add_eos and vocab.eos_id is None:
        raise fields.error(KEYS.ADD_EOS, "is true but there is no EOS id")


# ---- building the Hugging Face files


def build_tokenizer(vocab: GGUFVocab, source: str = "GGUF file") -> Tokenizer:
    """The ``tokenizers`` tokenizer for ``vocab``: BPE over the byte-level alphabet, with its added tokens."""
    spec = PRE_TOKENIZERS[vocab.pre]
    try:
        model = models.BPE(
            vocab={token: i for i, token in enumerate(vocab.tokens)},
            merges=list(vocab.merges),
            ignore_merges=spec.ignore_merges,
        )
        tokenizer = Tokenizer(model)
        if spec.normalizer is not None:
            tokenizer.normalizer = spec.normalizer()
        tokenizer.pre_tokenizer = spec.build()
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.post_processor = _post_processor(vocab)
        _add_tokens(tokenizer, vocab)
    except Exception as exc:  # tokenizers raises plain Exception
        raise ModelFilesError(f"{source}: its tokenizer cannot be built: {exc}") from None
    return tokenizer


def _add_tokens(tokenizer: Tokenizer, vocab: GGUFVocab) -> None:
    """As llama.cpp treats token types: CONTROL (and UNKNOWN) tokens are special, matched in text and left out of
    decode(skip_special_tokens=True); USER_DEFINED ones are matched in text and always decoded. Both are matched
    on the raw text, before any normalizer, as llama.cpp matches them."""
    special, user = [], []
    for token, kind in zip(vocab.tokens, vocab.token_types, strict=True):
        if kind in _SPECIAL_TYPES:
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == gguf.TokenType.USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def _post_processor(vocab: GGUFVocab) -> processors.PostProcessor:
    """Byte-level offsets, then BOS/EOS around each sequence where the file asks for them (as Llama 3's own)."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    first = _edge(vocab, vocab.add_bos, vocab.bos_id)
    last = _edge(vocab, vocab.add_eos, vocab.eos_id)
    if not (first or last):
        return byte_level
    template = processors.TemplateProcessing(
        single=[*(t for t, _ in first), "$A", *(t for t, _ in last)],
        pair=[*(t for t, _ in first), "$A", *(t for t, _ in last)]
        + [*(f"{t}:1" for t, _ in first), "$B:1", *(f"{t}:1" for t, _ in last)],
        special_tokens=list(dict.fromkeys(first + last)),
    )
    return processors.Sequence([byte_level, template])


def _edge(vocab: GGUFVocab, wanted: bool, token_id: int | None) -> list[tuple[str, int]]:
    return [(vocab.tokens[token_id], token_id)] if wanted and token_id is not None else []


def tokenizer_config(vocab: GGUFVocab) -> dict[str, Any]:
    """The ``tokenizer_config.json`` that goes with :func:`build_tokenizer`'s tokenizer."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.text(vocab.bos_id),
        "eos_token": vocab.text(vocab.eos_id),
        "pad_token": vocab.text(vocab.pad_id),
        "unk_token": vocab.text(vocab.unk_id),
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": PRE_TOKENIZERS[vocab.pre].clean_spaces,
        "added_tokens_decoder": _added_tokens_decoder(vocab),
    }
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    return config


def _added_tokens_decoder(vocab: GGUFVocab) -> dict[str, dict[str, Any]]:
    kinds = (*_SPECIAL_TYPES, gguf.TokenType.USER_DEFINED)
    return {
        str(i): {"content": token, "special": kind in _SPECIAL_TYPES, "normalized": False}
        for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True))
        if kind in kinds
    }
