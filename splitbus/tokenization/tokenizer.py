"""A served model's tokenizer, chat template and context length, from a Hugging Face folder."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, used when the model's tokenizer_config.json has no ``chat_template``."""

DEFAULT_CONTEXT = 2048


class ModelFilesError(ValueError):
    """A model folder lacks a file or holds one that cannot be read; the message names it."""


class ChatTemplateError(ValueError):
    """The chat template could not render these messages."""


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
    has_own_chat_template: bool
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None
    context_length: int

    @classmethod
    def load(cls, model_dir: Path | str, name: str | None = None) -> ModelTokenizer:
        """Read ``tokenizer.json``, ``tokenizer_config.json`` and ``config.json``."""
        folder = Path(model_dir)
        if not folder.is_dir():
            raise ModelFilesError(f"model folder {folder} does not exist")
        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ModelFilesError(f"{folder / 'tokenizer.json'} cannot be loaded: {exc}") from None
        tok_config = _read_json(folder / "tokenizer_config.json")
        config = _read_json(folder / "config.json")
        template = tok_config.get("chat_template")
        eos = _token_text(tok_config.get("eos_token"))
        return cls(
            name=name or folder.resolve().name,
            tokenizer=tokenizer,
            chat_template=template if isinstance(template, str) else FALLBACK_CHAT_TEMPLATE,
            has_own_chat_template=isinstance(template, str),
            eos_token_ids=_eos_ids(tokenizer, config, eos),
            bos_token=_token_text(tok_config.get("bos_token")),
            eos_token=eos,
            context_length=int(config.get("max_position_embeddings") or DEFAULT_CONTEXT),
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """As encode, for several texts; the Rust tokenizer releases the GIL while it runs."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @functools.cached_property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            template = _JINJA.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None


def _raise_exception(message: str) -> None:
    # Hugging Face chat templates call raise_exception() to reject messages they cannot format.
    raise TemplateError(message)


_JINJA = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_JINJA.globals["raise_exception"] = _raise_exception


def _eos_ids(tokenizer: Tokenizer, config: dict[str, Any], eos_token: str | None) -> tuple[int, ...]:
    ids = config.get("eos_token_id")
    found = ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else []
    if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
        found.append(tokenizer.token_to_id(eos_token))
    return tuple(dict.fromkeys(i for i in found if isinstance(i, int)))
