"""Token ids -> text deltas, with stop strings held back until they can no longer match, and
special tokens printed or not as the request asks (vLLM's ``skip_special_tokens`` and
``spaces_between_special_tokens``)."""

from __future__ import annotations

from collections import deque

from splitbus.bus.messages import SamplingParams
from splitbus.tokenization import ModelTokenizer


class TextStream:
    """Incremental detokenization (a window of recent tokens is decoded, so a character split
    over several byte tokens comes out whole) and stop-string matching.

    A decode worker that takes over a request replays the tokens already generated through a
    fresh TextStream and reaches the same state: no text state travels with the KV cache.
    """

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        stop: list[str],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._stops = StopMatcher([s for s in stop if s])
        self._skip = skip_special_tokens
        # As vLLM's detokenizer for fast tokenizers: with special tokens printed and this off, an
        # added token right after another prints as its bare text, without the separator the
        # tokenizer's decoder puts between tokens (WordPiece and decoder-less tokenizers do).
        self._bare_added = not (skip_special_tokens or spaces_between_special_tokens)
        self._after_added = False
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text is out of the window
        self._min_tokens = min_tokens
        """No stop string ends the request before the stream has more tokens than this (vLLM's
        ``min_tokens``); one that begins before and ends after does."""
        self.stopped = False

    @classmethod
    def for_request(cls, tokenizer: ModelTokenizer, sampling: SamplingParams) -> TextStream:
        """The stream for one request's sampling parameters (stop strings, special tokens, min_tokens)."""
        s = sampling
        return cls(tokenizer, s.stop, s.skip_special_tokens, s.spaces_between_special_tokens, s.min_tokens)

    @property
    def held(self) -> int:
        """Characters held back because they may begin a stop string (< the longest stop)."""
        return len(self._stops.held)

    @property
    def steps(self) -> int:
        """Characters compared by the stop check so far (the tests bound it)."""
        return self._stops.steps

    def push(self, token_ids: list[int]) -> str:
        """The text these tokens add that can be sent now; sets ``stopped`` on a stop string.

        One token at a time, as a worker generates them, so that a replay (a worker taking over
        a request pushes the tokens already sent, all at once) reaches the state the workers
        before it had: pushed together, tokens that end inside a character held back all their
        text, and the first token after the replay sent the whole text again."""
        return "".join(self._release(self._push_one(t)) for t in token_ids)

    def flush(self) -> str:
        """Everything not sent yet, when the request ends for another reason: text held for a
        possible stop string, and bytes that never completed a character."""
        if self.stopped:
            return ""
        full = self._decode(self._ids[self._prefix :])
        window = self._decode(self._ids[self._prefix : self._read])
        self._prefix = self._read = len(self._ids)
        text = self._release(full[len(window) :])
        return text + ("" if self.stopped else self._stops.take_held())

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip)

    def _push_one(self, token_id: int) -> str:
        """One token. When consecutive added tokens print bare, such a token's text is its own,
        and the window restarts at it (the text after it is decoded against it, as usual)."""
        bare = self._tokenizer.added_tokens.get(token_id) if self._bare_added else None
        follows_added, self._after_added = self._after_added, bare is not None
        if bare is None or not follows_added:
            self._ids.append(token_id)
            return self._new_text()
        pending = self._new_text()
        self._ids.append(token_id)
        self._prefix, self._read = len(self._ids) - 1, len(self._ids)
        return pending + bare

    def _new_text(self) -> str:
        window = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(window) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for its next byte
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(window) :]

    def _release(self, text: str) -> str:
        if self.stopped:
            return ""
        sendable, self.stopped = self._stops.feed(text, armed=len(self._ids) > self._min_tokens)
        return sendable


class StopMatcher:
    """The earliest stop string in a stream of text, found in O(new text) per call.

    Each stop string keeps a Knuth-Morris-Pratt state: the length of the longest prefix of it
    that the text seen so far ends with. A new character moves every state by amortized O(1)
    steps, so the cost of a token is O(stops x its characters), whatever the stops' length and
    however much text came before (the old check searched held + new text for every stop and
    tried every prefix of every stop on every token: 16 stops of 200k characters cost 0.24 s
    a token). The largest state is exactly how much text must be held back: that tail may still
    begin a stop string, everything before it never can. Held characters sit in a deque, so
    holding and releasing them is O(1) a character too, never a copy of the whole tail.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._fail = [_prefix_function(s) for s in stops]
        self._state = [0] * len(stops)
        self.held: deque[str] = deque()
        self.steps = 0

    def feed(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """(the text that can be sent now, whether a stop string was found). On a stop, the
        text before the earliest-starting stop is sent, the stop and all after it never is.
        Not ``armed``, a stop string that ends in ``text`` is text like any other."""
        if not self._stops:
            return text, False
        base = len(self.held)
        self.held.extend(text)
        cut = self._earliest_stop(text, base, armed)
        if cut is not None:
            sendable = "".join(self.held.popleft() for _ in range(cut))
            self.held.clear()
            return sendable, True
        release = len(self.held) - max(self._state)
        return "".join(self.held.popleft() for _ in range(release)), False

    def take_held(self) -> str:
        """The held tail, sent when the request ends for another reason than a stop."""
        text = "".join(self.held)
        self.held.clear()
        self._state = [0] * len(self._stops)
        return text

    def _earliest_stop(self, text: str, base: int, armed: bool) -> int | None:
        """Advance every state over ``text`` (which starts at ``base`` in the held deque); the
        held index where the earliest-starting completed stop begins, if any completed."""
        best: int | None = None
        for i, (stop, fail) in enumerate(zip(self._stops, self._fail, strict=False)):
            end = self._advance(i, stop, fail, text, armed)
            if end is not None:
                start = base + end + 1 - len(stop)
                best = start if best is None else min(best, start)
        return best

    def _advance(self, i: int, stop: str, fail: list[int], text: str, armed: bool) -> int | None:
        """Run stop ``i``'s state over ``text``; the index in ``text`` where it first completes
        (not ``armed``: none, the state goes on as after a mismatch of the next character)."""
        state, steps = self._state[i], 0
        for pos, char in enumerate(text):
            while state and stop[state] != char:
                state, steps = fail[state - 1], steps + 1
            steps += 1
            if stop[state] == char:
                state += 1
            if state == len(stop) and armed:
                self._state[i], self.steps = state, self.steps + steps
                return pos
            if state == len(stop):
                state = fail[state - 1]
        self._state[i], self.steps = state, self.steps + steps
        return None


def _prefix_function(s: str) -> list[int]:
    """KMP's failure table: fail[k] = the longest proper prefix of s[:k+1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail
