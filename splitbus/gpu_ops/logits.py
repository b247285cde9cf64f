"""Logits processors: what a request's sampling parameters do to one sequence's raw logits
before the sampler (``splitbus.gpu_ops.sampling.sample``) draws from them, in vLLM's order:
``min_tokens``, ``logit_bias``, then the repetition, frequency and presence penalties.

Each reads only the request's parameters, its prompt and the tokens it generated so far, so a
decode worker applies them to a request that P prefilled, or that moved, from its tokens alone.
A request that sets none of them gets its row back untouched (``process``): plain requests pay
for a few attribute reads. Runs in numpy, as the sampler does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np


class LogitsParams(Protocol):
    """The sampling parameters the processors read (``splitbus.bus.messages.SamplingParams``)."""

    @property
    def presence_penalty(self) -> float: ...

    @property
    def frequency_penalty(self) -> float: ...

    @property
    def repetition_penalty(self) -> float: ...

    @property
    def logit_bias(self) -> Mapping[str, float]:
        """Token id in decimal -> the number added to its logit."""

    @property
    def min_tokens(self) -> int: ...

    @property
    def stop_token_ids(self) -> Sequence[int]: ...


def active(params: LogitsParams, generated: int) -> bool:
    """Whether any processor changes the logits of a request that has generated ``generated`` tokens."""
    return bool(
        params.logit_bias
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or generated < params.min_tokens
    )


def process(
    logits: np.ndarray,
    params: LogitsParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    eos_ids: Sequence[int],
) -> np.ndarray:
    """The logits to sample the next token from: ``logits`` itself when no processor is active,
    else a processed float64 copy (the raw row stays as it was, for logprobs)."""
    if not active(params, len(output_ids)):
        return logits
    row = logits.astype(np.float64)
    if len(output_ids) < params.min_tokens:
        hold_off_stops(row, [*eos_ids, *params.stop_token_ids])
    if params.logit_bias:
        add_bias(row, params.logit_bias)
    if params.repetition_penalty != 1.0:
        penalize_repetition(row, [*prompt_ids, *output_ids], params.repetition_penalty)
    if params.frequency_penalty or params.presence_penalty:
        penalize_output(row, output_ids, params.frequency_penalty, params.presence_penalty)
    return row


def hold_off_stops(row: np.ndarray, stop_ids: Sequence[int]) -> None:
    """``min_tokens``: the tokens that would end the request (EOS, ``stop_token_ids``) cannot be
    drawn. Ids past the row are not the model's and are skipped (the bus bounds ids, not to a
    vocabulary). A row that would keep no token at all is left as it is: nothing else could be drawn."""
    ids = _in_row(stop_ids, row.shape[0])
    if np.unique(ids).size < row.shape[0]:
        row[ids] = -np.inf


def add_bias(row: np.ndarray, bias: Mapping[str, float]) -> None:
    """``logit_bias``: each value added to its token's logit (ids past the row skipped)."""
    ids = np.fromiter(map(int, bias), np.int64, len(bias))
    values = np.fromiter(bias.values(), np.float64, len(bias))
    inside = ids < row.shape[0]
    row[ids[inside]] += values[inside]


def penalize_repetition(row: np.ndarray, seen: Sequence[int], penalty: float) -> None:
    """``repetition_penalty`` (HF's and vLLM's): the logit of each token seen in the prompt or the
    output, divided by the penalty when positive, multiplied by it otherwise."""
    ids = np.unique(_in_row(seen, row.shape[0]))
    logits = row[ids]
    row[ids] = np.where(logits > 0, logits / penalty, logits * penalty)


def penalize_output(row: np.ndarray, output_ids: Sequence[int], frequency: float, presence: float) -> None:
    """OpenAI's ``frequency_penalty`` and ``presence_penalty``: each token's logit lowered by
    ``frequency`` times its count in the output so far, and by ``presence`` once if it is there."""
    ids, counts = np.unique(_in_row(output_ids, row.shape[0]), return_counts=True)
    row[ids] -= frequency * counts + presence  # the output's tokens only: O(output), not O(vocabulary)


def _in_row(ids: Sequence[int], size: int) -> np.ndarray:
    array = np.asarray(ids, dtype=np.int64)
    return array[array < size]
