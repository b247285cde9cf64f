"""Token sampling, counter-based: the random draw for step k of a request depends only on
(seed, k), so a decode worker continues a request's sampling with no RNG state transferred.

One definition, in two implementations over a batch's logits ``[B, vocab]``: numpy row by row
(``sample``, the reference; ``sample_on_host``) and Paddle ops over the batch where the model
left it (``sample_on_device``); ``sample_batch`` picks by where the logits are. A row at
temperature <= 0 is greedy: the largest logit, the lowest id among equal maxima. Any other row:

1. weights ``w = exp((logits - max) / temperature)`` in float64 (the largest weighs 1);
2. the kept ids: min-p keeps ``w >= min_p`` (vLLM's: at least min_p times the likeliest); top-k
   the k largest logits; top-p, over what those kept, the fewest largest weights whose sum
   reaches ``top_p`` of theirs. Ties at a cut go to the lowest ids: exactly k (or the fewest)
   are kept;
3. the draw: ``u`` from ``numpy.random.default_rng([seed, step])``; the kept weights summed in
   ascending id order; the first id whose running sum exceeds ``u`` times their total.

The draw walks ids, not probabilities in order: a row that asks for no top-k or top-p keeps the
whole vocabulary and is never sorted (sorting 152k logits cost 17-19 ms a row in numpy). Top-p
sorts only the largest ``TOP_P_K`` weights, and the whole row only when those fall short of p.
The float64 sums make the two implementations agree but where ``u`` falls within float64
rounding of a cut (about 1e-16 of a row's mass); greedy rows agree bit for bit (on the device,
``paddle.argmax``'s first of equal maxima: tested on the CPU kernel, never run on a GPU's).
(``paddle.seed`` is one global state and ``top_p_sampling`` has no CPU kernel: neither is used.)
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import paddle

TOP_P_K = 1024
"""How many of a top-p row's largest weights are sorted first: the whole row is sorted only when
these sum to less than top_p of it (a flat distribution)."""


def uniform(seed: int, step: int) -> float:
    """The draw of a request's ``step``-th token: from its seed and the step alone."""
    return float(np.random.default_rng([seed & 0xFFFFFFFF, step]).random())


def sample(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, step: int, min_p: float = 0.0
) -> int:
    """One row's token by the module's definition: the reference that ``sample_batch`` follows."""
    return _sample_row(logits, temperature, top_k, top_p, min_p, uniform(seed, step) if temperature > 0 else 0.0)


def _sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    if temperature <= 0.0:
        return int(np.argmax(logits))  # the lowest id among equal maxima
    weights = np.exp((logits.astype(np.float64) - logits.max()) / temperature)
    weights *= weights >= min_p
    if 0 < top_k < logits.shape[0]:
        kth = np.partition(logits, logits.shape[0] - top_k)[logits.shape[0] - top_k]
        weights *= _first(logits, kth, top_k)
    if top_p < 1.0:
        weights *= _top_p(weights, top_p)
    sums = np.cumsum(weights)
    last = int(np.searchsorted(sums, sums[-1]))  # the last id with weight: u * total may round up to the total
    return min(int(np.searchsorted(sums, u * sums[-1], side="right")), last)


def _first(values: np.ndarray, cut: float, count: int) -> np.ndarray:
    """Which of ``values`` are among its ``count`` largest, ``cut`` the smallest of those: all
    above the cut, and of those equal to it the lowest ids."""
    above = values > cut
    at = values == cut
    return above | (at & (np.cumsum(at) <= count - np.count_nonzero(above)))


def _top_p(weights: np.ndarray, top_p: float) -> np.ndarray:
    """The fewest largest ``weights`` whose sum reaches ``top_p`` of all: the largest
    ``TOP_P_K`` sorted, the whole row only when they fall short (their sums are the same)."""
    goal, size = top_p * weights.sum(), weights.shape[0]
    ordered = np.sort(np.partition(weights, size - min(TOP_P_K, size))[size - min(TOP_P_K, size) :])[::-1]
    sums = np.cumsum(ordered)
    if sums[-1] < goal:
        ordered = np.sort(weights)[::-1]
        sums = np.cumsum(ordered)
    keep = min(int(np.searchsorted(sums, goal)) + 1, len(ordered))
    return _first(weights, ordered[keep - 1], keep)


class Params(Protocol):
    """The sampling parameters a row's draw reads (``splitbus.bus.messages.SamplingParams``)."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def top_p(self) -> float: ...

    @property
    def min_p(self) -> float: ...


@dataclass(frozen=True)
class Draws:
    """One step's sampling parameters of a batch, an entry a row, uploaded once a step."""

    temperature: np.ndarray
    """float64; <= 0: the row is greedy."""
    top_k: np.ndarray
    """int64; 0 or the vocabulary or more: no top-k."""
    top_p: np.ndarray
    """float64; 1: no top-p."""
    min_p: np.ndarray
    """float64; 0: no min-p."""
    uniform: np.ndarray
    """float64: each row's draw (``uniform``); 0 for a greedy row, which draws nothing."""

    @classmethod
    def of(cls, params: Seq[Params], seeds: Seq[int], steps: Seq[int]) -> Draws:
        """The draws of a batch whose row j is a request with ``params[j]`` at ``steps[j]``."""
        temperature = np.array([p.temperature for p in params], dtype=np.float64)
        draws = [uniform(s, k) if t > 0 else 0.0 for t, s, k in zip(temperature, seeds, steps, strict=True)]
        return cls(
            temperature,
            np.array([p.top_k for p in params], dtype=np.int64),
            np.array([p.top_p for p in params], dtype=np.float64),
            np.array([p.min_p for p in params], dtype=np.float64),
            np.array(draws, dtype=np.float64),
        )

    def take(self, rows: np.ndarray) -> Draws:
        """These rows' draws."""
        return Draws(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows], self.uniform[rows])


def sample_batch(logits: paddle.Tensor, draws: Draws, replaced: Mapping[int, np.ndarray] | None = None) -> np.ndarray:
    """Each row's token (``[B]`` int64), as ``sample`` draws it from ``logits`` ``[B, vocab]``,
    or from ``replaced[j]`` for a row j whose logits were processed on the host (penalties, a
    grammar's mask). Where the logits are: on a GPU, Paddle's ops (``sample_on_device``), and only
    the tokens come to the host; on the CPU, numpy (``sample_on_host``), which ran the same draws
    3-8 times as fast as Paddle's CPU kernels (32 rows of 152k at temperature 1: 27-29 against
    123-131 ms; with top-p 0.9: 55-97 against 296-740 ms)."""
    if logits.place.is_cpu_place():
        return sample_on_host(_host_view(logits), draws, replaced or {})
    return sample_on_device(logits, draws, replaced or {})


def _host_view(logits: paddle.Tensor) -> np.ndarray:
    """CPU logits as numpy without a copy (dlpack), which only reads them: ``numpy()`` copied
    32 rows of 152k in 7.6 ms, as long as the rest of a greedy step. Paddle 2.6's tensors have
    no ``__dlpack__``: they copy."""
    return np.from_dlpack(logits) if hasattr(logits, "__dlpack__") else logits.numpy()


def sample_on_host(logits: np.ndarray, draws: Draws, replaced: Mapping[int, np.ndarray]) -> np.ndarray:
    """``sample_batch`` over logits on the host: ``sample`` row by row."""
    params = zip(draws.temperature, draws.top_k, draws.top_p, draws.min_p, draws.uniform, strict=True)
    tokens = [_sample_row(replaced.get(j, row), *p) for j, (row, p) in enumerate(zip(logits, params, strict=True))]
    return np.array(tokens, dtype=np.int64)


def sample_on_device(logits: paddle.Tensor, draws: Draws, replaced: Mapping[int, np.ndarray]) -> np.ndarray:
    """``sample_batch`` in Paddle ops where ``logits`` are; the rows in ``replaced`` uploaded into
    the batch, and one ``[B]`` copy of the tokens back."""
    greedy = np.flatnonzero(draws.temperature <= 0)
    drawn = np.flatnonzero(draws.temperature > 0)
    parts = []
    if greedy.size:
        parts.append(paddle.argmax(_rows(logits, greedy, replaced), axis=1))
    if drawn.size:
        parts.append(_draw(_rows(logits, drawn, replaced), draws.take(drawn)))
    tokens = paddle.concat(parts) if len(parts) > 1 else parts[0]
    return tokens.numpy().astype(np.int64)[np.argsort(np.concatenate([greedy, drawn]))]


def _rows(logits: paddle.Tensor, rows: np.ndarray, replaced: Mapping[int, np.ndarray]) -> paddle.Tensor:
    """``logits``' rows ``rows``, those in ``replaced`` replaced (then all in float64: a processed
    row is float64, and float32 logits widen exactly)."""
    part = logits if rows.size == logits.shape[0] else paddle.index_select(logits, paddle.to_tensor(rows))
    at = [i for i, j in enumerate(rows.tolist()) if j in replaced]
    if not at:
        return part
    values = np.stack([replaced[int(rows[i])] for i in at]).astype(np.float64)
    return paddle.scatter(part.astype("float64"), paddle.to_tensor(at), paddle.to_tensor(values), overwrite=True)


def _draw(logits: paddle.Tensor, draws: Draws) -> paddle.Tensor:
    """Steps 1-3 of the module's definition over rows that all sample."""
    wide = logits.astype("float64")
    weights = paddle.exp((wide - wide.max(axis=1, keepdim=True)) / _column(draws.temperature))
    if (draws.min_p > 0).any():
        weights = weights * (weights >= _column(draws.min_p)).astype("float64")
    weights = _keep_top_p(_keep_top_k(weights, logits, draws.top_k), draws.top_p)
    sums = paddle.cumsum(weights, axis=1)
    total = sums[:, -1:]
    last = paddle.searchsorted(sums, total)  # see ``sample``
    chosen = paddle.searchsorted(sums, _column(draws.uniform) * total, right=True)
    return paddle.minimum(chosen, last).reshape([-1])


def _keep_top_k(weights: paddle.Tensor, logits: paddle.Tensor, top_k: np.ndarray) -> paddle.Tensor:
    """``weights`` with those top-k drops at 0; rows without top-k pay nothing."""
    rows = np.flatnonzero((top_k > 0) & (top_k < logits.shape[1]))
    if not rows.size:
        return weights
    kept = _top_k(_select(logits, rows), top_k[rows])
    return _put(weights, rows, _select(weights, rows) * kept)


def _keep_top_p(weights: paddle.Tensor, top_p: np.ndarray) -> paddle.Tensor:
    """``weights`` with those top-p drops at 0; rows without top-p pay nothing."""
    rows = np.flatnonzero(top_p < 1)
    if not rows.size:
        return weights
    part = _select(weights, rows)
    return _put(weights, rows, part * _top_p_batch(part, top_p[rows]))


def _select(values: paddle.Tensor, rows: np.ndarray) -> paddle.Tensor:
    return values if rows.size == values.shape[0] else paddle.index_select(values, paddle.to_tensor(rows))


def _put(values: paddle.Tensor, rows: np.ndarray, part: paddle.Tensor) -> paddle.Tensor:
    """``values`` with its ``rows`` replaced by ``part`` (a new tensor: ``values`` may be shared)."""
    if rows.size == values.shape[0]:
        return part
    return paddle.scatter(values, paddle.to_tensor(rows), part, overwrite=True)


def _top_k(logits: paddle.Tensor, top_k: np.ndarray) -> paddle.Tensor:
    """Each row's ``top_k`` largest logits (ties: the lowest ids), as 1 and 0; one ``topk`` of the largest k."""
    ordered = paddle.topk(logits, int(top_k.max()), axis=1).values
    count = paddle.to_tensor(top_k[:, None])
    return _first_batch(logits, paddle.take_along_axis(ordered, count - 1, axis=1), count).astype("float64")


def _top_p_batch(weights: paddle.Tensor, top_p: np.ndarray) -> paddle.Tensor:
    """Each row's fewest largest weights whose sum reaches ``top_p`` of the row's, as 1 and 0:
    sorted among the largest ``TOP_P_K``, the whole row only for the rows where those fall short."""
    goal = _column(top_p) * weights.sum(axis=1, keepdim=True)
    ordered = paddle.topk(weights, min(TOP_P_K, weights.shape[1]), axis=1).values
    cut, count, reached = _top_p_cut(ordered, goal)
    short = np.flatnonzero(~reached.numpy().reshape(-1))  # [rows] bools: the one sync
    if short.size:
        whole = paddle.sort(_select(weights, short), axis=1, descending=True)
        whole_cut, whole_count, _ = _top_p_cut(whole, _select(goal, short))
        cut, count = _put(cut, short, whole_cut), _put(count, short, whole_count)
    return _first_batch(weights, cut, count).astype("float64")


def _top_p_cut(ordered: paddle.Tensor, goal: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Over weights sorted largest first: the smallest kept one and how many are kept
    (``[rows, 1]`` each), and whether these weights reach the goal at all."""
    sums = paddle.cumsum(ordered, axis=1)
    count = paddle.minimum(paddle.searchsorted(sums, goal) + 1, paddle.to_tensor(ordered.shape[1], dtype="int64"))
    return paddle.take_along_axis(ordered, count - 1, axis=1), count, sums[:, -1:] >= goal


def _first_batch(values: paddle.Tensor, cut: paddle.Tensor, count: paddle.Tensor) -> paddle.Tensor:
    """``_first`` over rows: ``cut`` and ``count`` are ``[rows, 1]``. Exact on any device (the
    order ``topk`` gives equal values in is not used)."""
    above = values > cut
    at = values == cut
    room = count - above.astype("int64").sum(axis=1, keepdim=True)
    return above | (at & (paddle.cumsum(at.astype("int64"), axis=1) <= room))


def _column(values: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(values[:, None])


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
