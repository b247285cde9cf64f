"""A served model's tokenizer, chat template and context length, from a Hugging Face folder."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from splitbus.tokenization.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate, ChatTemplateError, ChatTemplateLimit
from splitbus.tokenization.template_bounds import RenderLimits

__all__ = ["ChatTemplateError", "ChatTemplateLimit", "ModelFilesError", "ModelTokenizer"]

MAX_CHARS_PER_TOKEN = 16
"""Characters one token stands for at most, in practice, for the models served: ordinary text
is 3-5 characters a token; 16 leaves room for code and long whitespace runs. A prompt longer
than context x this cannot fit, so it is refused before the tokenizer spends time on it (and a
chat template's render is stopped there)."""

FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, used when the model folder has no chat template."""

DEFAULT_CONTEXT = 2048
MAX_TOKEN_ID = 2**31 - 1
"""The largest EOS id taken from a config file (the bus's bound on token ids)."""


class ModelFilesError(ValueError):
    """A model folder lacks a file or holds one that cannot be read; the message names it."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFilesError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise ModelFilesError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFilesError(f"{path} must hold a JSON object")
    return data


def _read_optional_json(path: Path) -> dict[str, Any] | None:
    return _read_json(path) if path.exists() else None


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class ModelTokenizer:
    name: str
    tokenizer: Tokenizer
    chat_template: str
    """The Jinja source: ``chat_template.jinja`` if the folder has one (transformers prefers it),
    else tokenizer_config.json's ``chat_template`` (a string, or the one named "default" of a
    list), else :data:`FALLBACK_CHAT_TEMPLATE`."""
    has_own_chat_template: bool
    eos_token_ids: tuple[int, ...]
    """Ids that end generation: generation_config.json's ``eos_token_id`` if the folder has the
    file (as transformers and vLLM read it), else config.json's, plus the id of tokenizer_config's
    ``eos_token`` (ChatML models end a turn on ``<|im_end|>`` whatever config.json says)."""
    bos_token: str | None
    eos_token: str | None
    context_length: int
    special_tokens: dict[str, Any] = field(default_factory=dict)
    """The special tokens the config sets, by transformers' names (``bos_token``, ...,
    ``additional_special_tokens``): the chat template gets them as variables."""

    @classmethod
    def load(cls, model_dir: Path | str, name: str | None = None) -> ModelTokenizer:
        """Read ``tokenizer.json``, ``tokenizer_config.json``, ``config.json`` and, when there,
        ``generation_config.json``, ``special_tokens_map.json`` and ``chat_template.jinja``."""
        folder = Path(model_dir)
        if not folder.is_dir():
            raise ModelFilesError(f"model folder {folder} does not exist")
        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ModelFilesError(f"{folder / 'tokenizer.json'} cannot be loaded: {exc}") from None
        tok_config = _read_json(folder / "tokenizer_config.json")
        config = _read_json(folder / "config.json")
        specials = _special_tokens(tok_config, _read_optional_json(folder / "special_tokens_map.json"))
        template = _chat_template(folder, tok_config)
        eos = specials.get("eos_token")
        return cls(
            name=name or folder.resolve().name,
            tokenizer=tokenizer,
            chat_template=template or FALLBACK_CHAT_TEMPLATE,
            has_own_chat_template=template is not None,
            eos_token_ids=_eos_ids(folder, tokenizer, config, eos),
            bos_token=specials.get("bos_token"),
            eos_token=eos,
            context_length=int(config.get("max_position_embeddings") or DEFAULT_CONTEXT),
            special_tokens=specials,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """As encode, for several texts; the Rust tokenizer releases the GIL while it runs.
        ``add_special_tokens``: what the tokenizer's post-processor adds (a BOS, say), which no
        prompt gets, for ``/tokenize``'s callers who ask."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of these ids; special tokens (added tokens marked special) print nothing unless
        ``skip_special_tokens`` is false, as in transformers and vLLM."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def added_tokens(self) -> dict[int, str]:
        """Id -> text of the tokens added to the vocabulary (special or not), such as ``<|im_end|>``."""
        return {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}

    @functools.cached_property
    def _template(self) -> ChatTemplate:
        return ChatTemplate(self.chat_template, self.special_tokens)  # compiled once, on first use

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        max_chars: int | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt ``apply_chat_template(messages, tools=tools, tokenize=False)`` returns; ChatTemplateError
        when the template fails on these messages, ChatTemplateLimit when its render runs past
        ``template_bounds.RENDER_TIME_S`` or builds more than ``max_chars`` characters (None:
        context length x MAX_CHARS_PER_TOKEN, more than could fit)."""
        limit = self.context_length * MAX_CHARS_PER_TOKEN if max_chars is None else max_chars
        return self._template.render(messages, RenderLimits(limit), add_generation_prompt, tools)


def _special_tokens(tok_config: dict[str, Any], token_map: dict[str, Any] | None) -> dict[str, Any]:
    """transformers' ``special_tokens_map``: tokenizer_config.json's values, else
    special_tokens_map.json's (older folders keep them there)."""
    found: dict[str, Any] = {}
    for source in (token_map or {}, tok_config):
        for key in SPECIAL_TOKEN_NAMES:
            text = _token_text(source.get(key))
            if text is not None:
                found[key] = text
        extra = source.get("additional_special_tokens")
        if isinstance(extra, list) and extra:
            found["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    return found


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text()
        except (OSError, ValueError) as exc:
            raise ModelFilesError(f"{jinja} cannot be read: {exc}") from None
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _eos_ids(folder: Path, tokenizer: Tokenizer, config: dict[str, Any], eos_token: str | None) -> tuple[int, ...]:
    generation = _read_optional_json(folder / "generation_config.json")
    source, file = (generation, "generation_config.json") if generation is not None else (config, "config.json")
    found = _id_list(source.get("eos_token_id"), folder / file)
    eos_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
    if eos_id is not None:
        found.append(eos_id)
    return tuple(dict.fromkeys(found))


def _id_list(value: Any, path: Path) -> list[int]:
    """``eos_token_id`` is null, one id, or a list of ids (most instruct models)."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(type(i) is int and 0 <= i <= MAX_TOKEN_ID for i in ids):
        raise ModelFilesError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return list(ids)
