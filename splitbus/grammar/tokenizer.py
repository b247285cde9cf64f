"""llguidance's view of a served model's vocabulary, built once per model and process.

llguidance computes a token mask from the bytes of every token (a trie over the vocabulary),
so it needs the tokenizer itself: it is given the model's ``tokenizer.json`` (what
``tokenizers.Tokenizer.to_str`` writes, for a folder's file or the one a GGUF file's vocabulary
was converted into alike) and the model's end-of-sequence ids, which a grammar allows once it
is complete. Building it walks the whole vocabulary (~0.25 s for SmolLM2's 49152 tokens on
one core), so each process builds it once per model, under a lock: the API's threads and a
worker's engine thread may all ask at once.
"""

from __future__ import annotations

import threading

from llguidance import LLTokenizer

from splitbus.grammar.outcomes import GrammarError
from splitbus.tokenization import ModelTokenizer

_BUILT: dict[int, tuple[ModelTokenizer, LLTokenizer]] = {}
"""id(model tokenizer) -> (that tokenizer, kept so that its id is not reused; llguidance's)."""
_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer: ModelTokenizer) -> LLTokenizer:
    """llguidance's tokenizer for ``tokenizer``'s model (built on first use, then cached);
    GrammarError when llguidance cannot read it (the model then serves no structured output)."""
    found = _BUILT.get(id(tokenizer))
    if found is not None:
        return found[1]
    with _LOCK:
        found = _BUILT.get(id(tokenizer))
        if found is None:
            found = (tokenizer, _build(tokenizer))
            _BUILT[id(tokenizer)] = found
    return found[1]


def _build(tokenizer: ModelTokenizer) -> LLTokenizer:
    # Every end id of the model: a complete grammar allows any of them, and the worker ends a
    # request on any (Sequence.add_token). Without one, the tokenizer's own guess.
    eos = list(tokenizer.eos_token_ids) or None
    try:
        return LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos)
    except Exception as exc:  # the Rust library's own errors: a tokenizer kind it does not read
        raise GrammarError("grammar", f"llguidance cannot read the tokenizer of {tokenizer.name}: {exc}") from None
