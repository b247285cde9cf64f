"""Chat templates rendered as Hugging Face transformers' ``apply_chat_template`` renders them.

A model's template is Jinja written against transformers' environment, so the same prompt
needs the same environment: a sandbox that cannot change the objects passed in, blocks that
trim their newline and leading whitespace, ``{% break %}``/``{% continue %}``, the
``{% generation %}`` tag, a ``tojson`` that keeps non-ASCII text and takes ``indent``, and the
``raise_exception`` and ``strftime_now`` globals. The variables are transformers' too:
``messages``, ``add_generation_prompt``, ``tools`` (the request's, as transformers passes them:
a list of ``{"type": "function", "function": {...}}``, or None) and ``documents`` (None: splitbus
takes none), and every special token the tokenizer config sets (``bos_token``, ``eos_token``, ...).

The template is the model's code, so its render is bounded in time and size
(``template_bounds``): past a bound, ``ChatTemplateLimit``, and the request fails alone. The API
renders in killable child processes (``template_process``), which bound what these checks cannot.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro

from splitbus.tokenization.template_bounds import BoundedSandbox, RenderLimits, TemplateLimitError, render_bounded

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special tokens transformers passes to a template when the tokenizer config sets them."""


RENDER_ERRORS = (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AssertionError)
"""What a template's own code raises on messages it cannot format (``'a' + none``, a missing
key): the request's error, not the server's."""


class ChatTemplateError(ValueError):
    """The chat template could not render these messages."""


class ChatTemplateLimit(ChatTemplateError):
    """The chat template went past a bound of its render (time, size): it is the model's code,
    not the client's messages, that failed, but the request fails all the same."""


class GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's part of a training
    prompt (transformers tracks it to build an assistant-token mask); rendering a prompt only
    needs its body, unchanged."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    # Templates call raise_exception() to reject messages they cannot format.
    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, ') and takes no separators: the
    # prompt would differ from the one the model was trained on.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    # Llama 3.x templates print today's date into the system prompt.
    return datetime.now().strftime(format)


def _environment() -> BoundedSandbox:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.bound_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


class ChatTemplate:
    """One compiled template and the special tokens it is given."""

    def __init__(self, source: str, special_tokens: dict[str, Any]) -> None:
        self.source = source
        self._special_tokens = special_tokens
        try:
            self._template = _ENV.from_string(source)
        except (TemplateError, RecursionError, MemoryError) as exc:  # a parser fed with '(' * 2000 recurses
            self._error: str | None = f"the chat template does not compile: {type(exc).__name__}: {exc}"
        else:
            self._error = None

    def render(
        self,
        messages: list[dict[str, Any]],
        limits: RenderLimits,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text; ChatTemplateError when the template fails or rejects the messages,
        ChatTemplateLimit when it goes past ``limits``."""
        if self._error is not None:
            raise ChatTemplateError(self._error)
        variables = {
            "messages": messages,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **self._special_tokens,
        }
        try:
            return render_bounded(lambda: self._template.generate(variables), limits)
        except TemplateLimitError as exc:
            raise ChatTemplateLimit(str(exc)) from None
        except RENDER_ERRORS as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None
