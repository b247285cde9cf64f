"""A choice's text and logprobs as OpenAI's responses show them, from the results the workers send
(``TokenDelta``: token ids, their text, and their ``Logprobs`` as ids and values).

The completions API shows a token's logprobs as four parallel lists (``tokens``,
``token_logprobs``, ``top_logprobs`` as {token: logprob}, ``text_offset``); chat as a list of
``content`` items (``token``, ``logprob``, ``bytes``, ``top_logprobs`` as a list). ``echo`` puts
the prompt first, its first token with no logprob. vLLM's ``prompt_logprobs`` is a list, null
first, of {token id: {logprob, rank, decoded_token}}.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from splitbus.api.protocol import GenerationParams
from splitbus.bus.messages import Finished, Logprobs, TokenDelta
from splitbus.tokenization import ModelTokenizer

Entry = tuple[int, float | None, list[tuple[int, float]] | None]
"""One token as logprobs show it: its id, its logprob and its top (id, logprob) pairs (none for a
prompt's first token)."""
log = logging.getLogger(__name__)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Label:
    text: str
    """The token as logprobs name it: its text alone, or ``bytes:\\xNN...`` for part of a character."""
    raw: bytes
    """Its bytes (chat's ``bytes``)."""
    chars: int
    """The characters it adds to the text (completions' ``text_offset``)."""


class TokenLabels:
    """Each token's ``Label``, made once per token id (at most the vocabulary's size): the token
    decoded alone, special tokens printed. A token that holds part of a multi-byte character
    decodes alone to U+FFFD; it shows as ``bytes:`` and its bytes, as OpenAI and vLLM show it,
    where its vocabulary says them (byte-level BPE, or a ``<0xNN>`` byte-fallback token)."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tokenizer = tokenizer
        self._labels: dict[int, Label] = {}

    def __call__(self, token_id: int) -> Label:
        label = self._labels.get(token_id)
        if label is None:
            label = self._label(token_id)
            if token_id < self._tokenizer.vocab_size:  # the cache holds the vocabulary at most
                self._labels[token_id] = label
        return label

    def _label(self, token_id: int) -> Label:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        raw = _raw_bytes(self._tokenizer.tokenizer.id_to_token(token_id) or "") if REPLACEMENT in text else None
        if raw is None:
            return Label(text, text.encode(), len(text))
        return Label("bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw, len(text))


def _raw_bytes(piece: str) -> bytes | None:
    """The bytes of a vocabulary piece that is not whole characters, if its form says them."""
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    table = _byte_level()
    return bytes(table[c] for c in piece) if piece and all(c in table for c in piece) else None


@functools.cache
def _byte_level() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's table, which its tokenizers share):
    printable bytes stand for themselves, the others for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    return table


def entries(token_ids: Sequence[int], logprobs: Logprobs | None) -> list[Entry]:
    if logprobs is None:
        return [(t, None, None) for t in token_ids]
    rows = zip(token_ids, logprobs.token, logprobs.top_ids, logprobs.top, strict=True)
    return [(t, lp, list(zip(ids, top, strict=True))) for t, lp, ids, top in rows]


def merged(results: Sequence[TokenDelta | Finished]) -> TokenDelta | Finished:
    """Results of a request, in order, as one: the last one's kind and ending, their tokens, text
    and logprobs one after the other. Joined once, whatever their number: a reply of thousands of
    entries costs the event loop linear time (merging them two by two copied everything so far
    each time)."""
    if len(results) == 1:
        return results[0]
    prompt = next((r.prompt_logprobs for r in results if r.prompt_logprobs is not None), None)
    return dataclasses.replace(
        results[-1],
        text="".join(r.text for r in results),
        token_ids=[t for r in results for t in r.token_ids],
        logprobs=_joined([r.logprobs for r in results if r.logprobs is not None]),
        prompt_logprobs=prompt,
    )


def _joined(runs: list[Logprobs]) -> Logprobs | None:
    """Runs of logprobs one after the other, each column joined once."""
    if not runs:
        return None
    return Logprobs(
        [x for run in runs for x in run.token],
        [x for run in runs for x in run.top_ids],
        [x for run in runs for x in run.top],
    )


@dataclass(frozen=True)
class Piece:
    """What one result adds to a choice."""

    text: str
    logprobs: dict[str, Any] | None
    """The choice's ``logprobs`` for this piece, when the request asked for them."""
    prompt_logprobs: list[dict[str, Any] | None] | None
    """vLLM's ``prompt_logprobs``, with the first piece of a request that asked for them."""


class Choice:
    """One choice of a response, result by result: ``piece`` is called with each result (or with
    all of them merged), in order, and says what the client gets of it."""

    def __init__(self, params: GenerationParams, prompt_ids: list[int], labels: TokenLabels, prompt_text: str) -> None:
        self.params, self.prompt_ids, self.labels, self.prompt_text = params, prompt_ids, labels, prompt_text
        self.offset = 0
        """Completions' ``text_offset`` of the next token."""
        self.started = False

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt alone (the worker generates one token, dropped)."""
        return self.params.echo and self.params.max_tokens == 0

    def piece(self, result: TokenDelta | Finished) -> Piece:
        shown = self.params.logprobs is not None and not self.echo_only  # else no entry is rendered
        items = entries(result.token_ids, result.logprobs) if shown else []
        text = "" if self.echo_only else result.text
        prompt = None
        if not self.started:
            self.started = True
            scored = self._checked(result.prompt_logprobs)
            prompt = self._prompt_logprobs(scored)
            if self.params.echo:
                text = self.prompt_text + text
                items = self._prompt_entries(scored) + items if self.params.logprobs is not None else items
        return Piece(text, self._render(items), prompt)

    def _checked(self, logprobs: Logprobs | None) -> Logprobs | None:
        """A worker's prompt logprobs, if they score this prompt (one row per token after the
        first); others are left out, and logged, rather than fail the reply."""
        if logprobs is not None and len(logprobs) != len(self.prompt_ids) - 1:
            log.warning(
                "prompt logprobs of %d rows for a %d-token prompt: left out", len(logprobs), len(self.prompt_ids)
            )
            return None
        return logprobs

    def _prompt_entries(self, logprobs: Logprobs | None) -> list[Entry]:
        """The echoed prompt's tokens, with the top ``logprobs`` of each (the worker computed the
        larger of that and ``prompt_logprobs``)."""
        k = self.params.logprobs or 0
        rest = [(t, lp, top[:k] if top else top) for t, lp, top in entries(self.prompt_ids[1:], logprobs)]
        return [(self.prompt_ids[0], None, None), *rest]

    def _render(self, items: list[Entry]) -> dict[str, Any] | None:
        if self.params.logprobs is None:
            return None
        if self.params.kind == "chat":
            return {"content": [self._chat_item(t, lp, top) for t, lp, top in items], "refusal": None}
        return self._completion(items)

    def _completion(self, items: list[Entry]) -> dict[str, Any]:
        shown: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top in items:
            label = self.labels(token)
            shown["tokens"].append(label.text)
            shown["token_logprobs"].append(logprob)
            shown["top_logprobs"].append(None if top is None else self._top_map(token, logprob, top))
            shown["text_offset"].append(self.offset)
            self.offset += label.chars
        return shown

    def _top_map(self, token: int, logprob: float | None, top: list[tuple[int, float]]) -> dict[str, float]:
        """The top alternatives, and the token itself (OpenAI: up to ``logprobs`` + 1 entries)."""
        shown = {self.labels(i).text: value for i, value in top}
        shown.setdefault(self.labels(token).text, logprob if logprob is not None else 0.0)
        return shown

    def _chat_item(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None) -> dict[str, Any]:
        item = self._chat_token(token, logprob)
        item["top_logprobs"] = [self._chat_token(i, value) for i, value in top or []]
        return item

    def _chat_token(self, token: int, logprob: float | None) -> dict[str, Any]:
        label = self.labels(token)
        return {"token": label.text, "logprob": logprob, "bytes": list(label.raw)}

    def _prompt_logprobs(self, logprobs: Logprobs | None) -> list[dict[str, Any] | None] | None:
        if self.params.prompt_logprobs is None or logprobs is None:
            return None
        rows: list[dict[str, Any] | None] = [None]
        k = self.params.prompt_logprobs
        for token, logprob, top in entries(self.prompt_ids[1:], logprobs):
            ranked: dict[int, tuple[float, int | None]] = {
                i: (value, rank) for rank, (i, value) in enumerate((top or [])[:k], start=1)
            }
            ranked.setdefault(token, (logprob or 0.0, None))
            rows.append({str(i): self._vllm_logprob(i, v, r) for i, (v, r) in ranked.items()})
        return rows

    def _vllm_logprob(self, token: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.labels(token).text}
