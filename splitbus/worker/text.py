"""Token ids -> text deltas, with stop strings held back until they can no longer match."""

from __future__ import annotations

from splitbus.tokenization import ModelTokenizer


class TextStream:
    """Incremental detokenization (a window of recent tokens is decoded, so a character split
    over several byte tokens comes out whole) and stop-string matching.

    A decode worker that takes over a request replays the tokens already generated through a
    fresh TextStream and reaches the same state: no text state travels with the KV cache.
    """

    def __init__(self, tokenizer: ModelTokenizer, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text is out of the window
        self._held = ""  # text that may be the start of a stop string
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """The text these tokens add that can be sent now; sets ``stopped`` on a stop string."""
        self._ids += token_ids
        return self._release(self._held + self._new_text())

    def flush(self) -> str:
        """Everything not sent yet, when the request ends for another reason: text held for a
        possible stop string, and bytes that never completed a character."""
        if self.stopped:
            return ""
        full = self._tokenizer.decode(self._ids[self._prefix :])
        window = self._tokenizer.decode(self._ids[self._prefix : self._read])
        self._prefix = self._read = len(self._ids)
        text = self._release(self._held + full[len(window) :])
        rest, self._held = ("" if self.stopped else self._held), ""
        return text + rest

    def _new_text(self) -> str:
        window = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full = self._tokenizer.decode(self._ids[self._prefix :])
        if len(full) <= len(window) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for its next byte
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(window) :]

    def _release(self, text: str) -> str:
        if self.stopped:
            return ""
        hits = [text.index(s) for s in self._stop if s in text]
        if hits:
            self.stopped = True
            self._held = ""
            return text[: min(hits)]
        keep = max((n for s in self._stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]
