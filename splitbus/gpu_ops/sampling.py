"""Token sampling, counter-based: the random draw for step k of a request depends only on
(seed, k), so a decode worker continues a request's sampling with no RNG state transferred.

Order (vLLM's): temperature, then min-p, top-k and top-p; ties are broken by token id. Runs in
numpy on the logits of one sequence, which ``splitbus.gpu_ops.logits`` has processed before
(Paddle's ``top_p_sampling`` has no CPU kernel and ``paddle.seed`` is one global state).
"""

from __future__ import annotations

import numpy as np


def sample(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, step: int, min_p: float = 0.0
) -> int:
    if temperature <= 0.0:
        return int(np.argmax(logits))  # the lowest id among equal maxima
    scaled = logits.astype(np.float64) / temperature
    candidates = _top_k(scaled, top_k)
    probs = np.exp(scaled[candidates] - scaled[candidates].max())
    probs /= probs.sum()
    if min_p > 0.0:
        candidates, probs = _min_p(candidates, probs, min_p)
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
        candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
    draw = np.random.default_rng([seed & 0xFFFFFFFF, step]).random()
    index = min(int(np.searchsorted(np.cumsum(probs), draw, side="right")), len(candidates) - 1)
    return int(candidates[index])


def _top_k(scaled: np.ndarray, top_k: int) -> np.ndarray:
    """Candidate ids by descending logit, ties by ascending id; only the top k when k > 0."""
    ids = np.arange(scaled.shape[0])
    if 0 < top_k < scaled.shape[0]:
        ids = np.argpartition(-scaled, top_k - 1)[:top_k]
    return ids[np.lexsort((ids, -scaled[ids]))]


def log_softmax_top(rows: np.ndarray, targets: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The log softmax of each of ``rows`` (logits, ``[n, vocab]``), raw: no temperature, penalty
    or mask. Returns each row's value at its ``targets`` id (``[n]``) and its top ``k`` ids and
    values (``[n, k]``, most likely first, ties by id), in float64. Only the values asked for are
    made: the row, less its largest logit, stays float32 (exact to a float32 logit's precision),
    and its exponentials are summed in float64, which keeps the small probabilities' digits over
    a 150k vocabulary; a float64 copy of the whole row cost 8 times as much (0.94 against 0.11 ms
    a 49k row). A token's value and its value among the top ones are the same expression: equal
    to the bit."""
    shifted = rows - rows.max(axis=1, keepdims=True)
    norm = np.log(np.exp(shifted).sum(axis=1, dtype=np.float64))
    chosen = shifted[np.arange(len(rows)), targets].astype(np.float64) - norm
    k = min(max(k, 0), rows.shape[1])
    if k == 0:
        return chosen, np.zeros((len(rows), 0), dtype=np.int64), np.zeros((len(rows), 0))
    part = np.stack([_top_ids(row, k) for row in shifted])
    values = np.take_along_axis(shifted, part, axis=1).astype(np.float64) - norm[:, None]
    return chosen, part, values


def _top_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` largest of ``row``'s ids, largest first, ties by id, as ``argmax`` picks the first
    of equal maxima: every id tied with the k-th is a candidate (``argpartition`` alone would
    keep any of them)."""
    if k < row.shape[0]:
        kth = np.partition(row, row.shape[0] - k)[row.shape[0] - k]
        ids = np.flatnonzero(row >= kth)
    else:
        ids = np.arange(row.shape[0])
    return ids[np.lexsort((ids, -row[ids]))][:k]


def _min_p(candidates: np.ndarray, probs: np.ndarray, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The candidates at least ``min_p`` times as likely as the likeliest (vLLM's min-p), which
    leads the descending ``probs``. Its ratios are the same before top-k and after, so applying it
    to top-k's candidates is vLLM's min-p-then-top-k."""
    keep = int(np.count_nonzero(probs >= min_p * probs[0]))
    return candidates[:keep], probs[:keep] / probs[:keep].sum()
