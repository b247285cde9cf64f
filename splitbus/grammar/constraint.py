"""A request's grammar on a worker: the tokens it allows next, and where it stands.

A ``Constraint`` is an llguidance matcher built from the request's grammar (its bus field,
``SamplingParams.grammar``) and the model's vocabulary. It holds no state but the tokens it was
given: a worker that takes a request over (P -> D hand-off, a migration) builds a fresh one and
gives it the tokens generated so far (``follow``), reaching the state the other worker had.

The grammar is untrusted (the bus is a trust boundary; the API compiled it, but anyone who can
write a stream could have written the entry): llguidance never raises on a bad grammar or a token
it refuses, it enters an error state, which ``build`` and ``follow`` turn into ``GrammarError``
so that only that request fails.
"""

from __future__ import annotations

import logging

import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from splitbus.grammar.outcomes import Advance, GrammarError

log = logging.getLogger(__name__)
FIELD = "grammar"
"""What a worker's GrammarError names: the bus field."""
LIMITS = LLParserLimits(initial_lexer_fuel=200_000, verbose_errors=False)
"""llguidance's bounds on a matcher's work, the same in the API's trial and on the worker.
llguidance's defaults but the fuel of the lexer's first build, 1,000,000 by default: a regex such
as ``((a{100}){100}){100}`` spent 0.6-1.2 s of its first mask on it (then failed, too many
expressions) on this machine's CPU, 63 ms with 200,000; the JSON schemas, choices and regexes of
tests/grammar and bench grammar build and run alike under both."""


class Constraint:
    """One request's llguidance matcher and how many of its tokens it has taken."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos: tuple[int, ...] = ()) -> None:
        self._matcher = matcher
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.vocab_size = vocab_size
        self.eos = eos
        """The model's end-of-sequence ids: allowed once the grammar is complete."""
        self.taken = 0
        """Generated tokens the matcher has consumed."""

    @classmethod
    def build(cls, tokenizer: LLTokenizer, grammar: str) -> Constraint:
        """The constraint at the start of generation; GrammarError when the grammar does not build."""
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(FIELD, f"the grammar does not build: {matcher.get_error()[:1000]}")
        return cls(matcher, tokenizer.vocab_size, tuple(tokenizer.eos_tokens))

    @property
    def error(self) -> str:
        """Why the matcher stopped working ("" while it works): a limit it ran into, a token it refused."""
        return self._matcher.get_error()

    def follow(self, tokens: list[int]) -> None:
        """Take the tokens of ``tokens`` (all the request's generated tokens) not taken yet;
        GrammarError when they break the grammar (tokens from another worker that were not
        generated under it)."""
        fresh = tokens[self.taken :]
        if fresh and not self._matcher.consume_tokens(fresh):
            raise GrammarError(FIELD, f"the generated tokens break the grammar: {self._matcher.get_error()[:1000]}")
        self.taken = len(tokens)

    def advance(self, token: int) -> Advance:
        """Take one generated token."""
        self.taken += 1
        if not self._matcher.consume_token(token):
            log.error("token %d broke a request's grammar: %s", token, self._matcher.get_error()[:1000])
            return Advance.REFUSED
        return Advance.COMPLETE if self._matcher.is_stopped() else Advance.GOING

    @property
    def accepting(self) -> bool:
        """Whether the output so far is complete under the grammar (it may still go on)."""
        return self._matcher.is_accepting()

    def allowed(self) -> np.ndarray:
        """Whether each token of the vocabulary may come next (bools, ``vocab_size`` of them). A
        matcher that fails here (a limit of ``LIMITS`` in a state the API's trial did not reach)
        allows only the end-of-sequence tokens: the request stops, its error logged."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():
            return self._only_eos()
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.vocab_size).view(bool)

    def _only_eos(self) -> np.ndarray:
        log.error("a request's grammar failed; it ends here: %s", self.error[:1000])
        allowed = np.zeros(self.vocab_size, dtype=bool)
        allowed[[t for t in self.eos if t < self.vocab_size]] = True
        return allowed

    def allowed_ids(self) -> np.ndarray:
        """The ids of the tokens that may come next, ascending."""
        return np.flatnonzero(self.allowed())


def mask_logits(constraint: Constraint | None, logits: np.ndarray) -> np.ndarray:
    """``logits`` (one sequence's row) with every token the grammar refuses at -inf; the row
    itself when the request has no grammar. Logits past the tokenizer's vocabulary (a model's
    padded embedding rows) are no token: refused."""
    if constraint is None:
        return logits
    return apply_mask(constraint.allowed(), logits)


def apply_mask(allowed: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """``logits`` with every token not ``allowed`` (and any past its length) at -inf, a copy.
    Branch-free: log(1) = 0 and log(0) = -inf, added to the row. ``np.where`` on a mask that
    changes token by token (a JSON string allows about half the vocabulary, at random) ran at
    ~220 us for 49k tokens on one core, mispredicting; this runs at ~20 us."""
    keep = np.zeros(logits.shape[-1], dtype=logits.dtype)
    n = min(len(allowed), len(keep))
    keep[:n] = allowed[:n]
    with np.errstate(divide="ignore"):
        np.log(keep, out=keep)
    keep += logits
    return keep


END_BIAS = 0.25
"""How often ``choose`` prefers a token that ends something (the output, a string, a container)."""


def choose(constraint: Constraint | None, own: int, closers: tuple[int, ...], draw: float) -> int:
    """A deterministic engine's token under the grammar (the sim engine's): ``own``, the token it
    would emit unconstrained, when the grammar allows it. With probability ``END_BIAS`` (by
    ``draw``, uniform in [0, 1)) the first allowed of the end-of-sequence ids and ``closers``
    (tokens that close a string or a container: ``"``, ``}``, ``]``) comes first, so that free
    text (a JSON string, nested values) ends in a few tokens instead of running to max_tokens.
    Otherwise the allowed token of the lowest id: byte-level vocabularies begin with the printable
    characters, so JSON gets its punctuation rather than one of the many whitespace tokens it
    allows between values (a draw among all of them wrote mostly blanks). The choice depends only
    on (own, draw, the grammar's state), so a request that moves to another worker continues the
    same output."""
    if constraint is None:
        return own
    allowed = constraint.allowed()
    if draw < END_BIAS:
        first = next((t for t in (*constraint.eos, *closers) if t < len(allowed) and allowed[t]), None)
        if first is not None:
            return first
    if own < len(allowed) and allowed[own]:
        return own
    lowest = int(np.argmax(allowed))
    return lowest if allowed[lowest] else own  # none allowed: the grammar has failed already
