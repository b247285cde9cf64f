"""What a decode worker accepts in a KV frame's meta: exactly what the prefill worker its task
names could have sent.

P prefills once and publishes one entry (its first token), so its frame carries the tokens the
task already had plus the ones P made, and the ``seq`` D continues at: the task's
``first_seq`` plus one per new token. Anything else is not a frame P sent, and D would hang
the stream (a ``seq`` gap), crash (a negative one) or decode nonsense if it took it.
"""

from __future__ import annotations

from typing import Any

from splitbus.bus.messages import Task


def meta_problem(task: Task, meta: dict[str, Any], vocab_size: int) -> str | None:
    """Why ``meta`` cannot be the hand-off of ``task``'s request, or None."""
    tokens = meta.get("output_token_ids")
    problem = _tokens_problem(task, tokens, vocab_size)
    if problem is not None:
        return problem
    assert isinstance(tokens, list)
    expected = task.first_seq + len(tokens) - len(task.output_token_ids)
    next_seq = meta.get("next_seq")
    if type(next_seq) is not int or next_seq != expected:
        return f"next_seq must be {expected} (one entry per token after first_seq {task.first_seq}), got {next_seq!r}"
    return None


def _tokens_problem(task: Task, tokens: Any, vocab_size: int) -> str | None:
    before, max_tokens = task.output_token_ids, task.request.sampling.max_tokens
    if type(tokens) is not list or not tokens:
        return "output_token_ids must be a non-empty list of token ids"
    if not len(before) < len(tokens) < max_tokens:
        # P hands off only an unfinished request, so it sent fewer than max_tokens tokens.
        return f"output_token_ids holds {len(tokens)} tokens; expected {len(before) + 1} to {max_tokens - 1}"
    if any(type(t) is not int or not 0 <= t < vocab_size for t in tokens):
        return f"output_token_ids must hold integers in [0, {vocab_size})"
    if tokens[: len(before)] != before:
        return "output_token_ids must start with the task's own output_token_ids"
    return None
