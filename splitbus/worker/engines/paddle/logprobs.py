"""Logprobs as the bus carries them (``Logprobs``), from the model's raw logits (the sim engine
makes up its own: ``sim.py``)."""

from __future__ import annotations

import numpy as np

from splitbus.bus.messages import Logprobs
from splitbus.bus.messages._check import MIN_LOGPROB
from splitbus.gpu_ops.sampling import log_softmax_top
from splitbus.worker.sequence import Sequence

PROMPT_ROWS = 256
"""Prompt positions whose logits are made at once for prompt logprobs: a 2048-token prompt's
logits over a 150k vocabulary would take 1.2 GB at once; 256 rows take 150 MB."""


def of_rows(rows: np.ndarray, targets: np.ndarray, k: int) -> Logprobs:
    """The logprobs of ``targets``, one per row of logits, with the top ``k`` of each row."""
    chosen, ids, values = log_softmax_top(rows, targets, k)
    floor = MIN_LOGPROB
    return Logprobs(np.maximum(chosen, floor).tolist(), ids.tolist(), np.maximum(values, floor).tolist())


def sampled(seq: Sequence, row: np.ndarray, token: int) -> None:
    """Record the logprobs of the token just chosen from ``row`` on ``seq`` when its request asks
    for them; the next ``emit`` sends them with the token."""
    k = seq.request.sampling.logprobs
    if k is not None:
        seq.logprobs = of_rows(row[None, :], np.array([token]), k)
