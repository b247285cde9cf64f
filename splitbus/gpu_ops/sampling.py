"""Token sampling, counter-based: the random draw for step k of a request depends only on
(seed, k), so a decode worker continues a request's sampling with no RNG state transferred.

Order: temperature, then top-k, then top-p; ties are broken by token id. Runs in numpy on the
logits of one sequence (Paddle's ``top_p_sampling`` has no CPU kernel and ``paddle.seed`` is
one global state).
"""

from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, step: int) -> int:
    if temperature <= 0.0:
        return int(np.argmax(logits))  # the lowest id among equal maxima
    scaled = logits.astype(np.float64) / temperature
    candidates = _top_k(scaled, top_k)
    probs = np.exp(scaled[candidates] - scaled[candidates].max())
    probs /= probs.sum()
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
