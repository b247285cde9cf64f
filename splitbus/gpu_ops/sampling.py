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

A row with nothing to draw from (its largest logit not finite: every token masked to -inf, a NaN,
an overflow to +inf) draws nothing: its token is the argmax of its raw row, the model's logits
before any processor or mask (NaN read as -inf; every one NaN: id 0). ``min_tokens`` holding
back the only tokens a grammar allows masks a whole row; a bf16 overflow leaves NaN or inf. The
token is then one the processors or the grammar refused (a grammar takes it as the end of the
request's output), but it is defined, and the same on both paths.

The draw walks ids, not probabilities in order: a row that asks for no top-k or top-p keeps the
whole vocabulary and is never sorted (sorting 152k logits cost 17-19 ms a row in numpy). Top-p
sorts only the largest ``TOP_P_K`` weights, and the whole row only when those fall short of p.
The float64 sums make the two implementations agree but where ``u`` falls within the sums'
rounding of a cut: numpy adds the weights in order, a GPU's cumsum in another order, and their
sums over ``n`` ids may differ by up to ``n`` float64 epsilons of a row's mass (about 1e-11 at
152k ids; typically 1e-14). Greedy rows agree bit for bit (on the device, ``paddle.argmax``'s
first of equal maxima: tested on the CPU kernel, never run on a GPU's).
(``paddle.seed`` is one global state and ``top_p_sampling`` has no CPU kernel: neither is used.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
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
    """One row's token by the module's definition: the reference that ``sample_batch`` follows
    (``logits`` is its own raw row, should it have nothing to draw from)."""
    u = uniform(seed, step) if temperature > 0 else 0.0
    token = _sample_row(logits, temperature, top_k, top_p, min_p, u)
    return token if token >= 0 else raw_argmax(logits)


def raw_argmax(raw: np.ndarray) -> int:
    """The token of a row with nothing to draw from: its raw row's largest logit, the lowest id
    among equal maxima, NaN read as -inf (every one NaN or -inf: id 0)."""
    return int(np.argmax(np.where(np.isnan(raw), -np.inf, raw)))


def _sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """The row's token; -1 when its largest logit is not finite (numpy's max and argmax take a
    NaN as the largest): it has nothing to draw from."""
    if temperature <= 0.0:
        best = int(np.argmax(logits))  # the lowest id among equal maxima
        return best if np.isfinite(logits[best]) else -1
    top = logits.max()
    if not np.isfinite(top):
        return -1
    weights = np.exp((logits.astype(np.float64) - top) / temperature)
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
    the tokens come to the host (and, when a row asks for top-p, one bool a row mid-way:
    ``_top_p_batch``); on the CPU, numpy (``sample_on_host``), which ran the same draws several
    times as fast as Paddle's CPU kernels (docs/engine.md's Sampling has the figures)."""
    if logits.place.is_cpu_place():
        return sample_on_host(_host_view(logits), draws, replaced or {})
    return sample_on_device(logits, draws, replaced or {})


def _host_view(logits: paddle.Tensor) -> np.ndarray:
    """CPU logits as numpy without a copy (dlpack), which only reads them: ``numpy()`` copied
    32 rows of 152k in 7.6 ms, as long as the rest of a greedy step. Paddle 2.6's tensors have
    no ``__dlpack__``: they copy. bf16 logits are widened first (a copy; numpy has no bf16)."""
    logits = widened(logits)
    return np.from_dlpack(logits) if hasattr(logits, "__dlpack__") else logits.numpy()


def widened(values: paddle.Tensor) -> paddle.Tensor:
    """``values`` in float32 where they are narrower (bf16, float16), else as they are: exact.
    Before numpy sees them (it has no bf16: ``numpy()`` of a bf16 tensor gives its raw uint16
    bits) and before Paddle's argmax, which has no bf16 kernel on the CPU."""
    return values if values.dtype in (paddle.float32, paddle.float64) else values.astype("float32")


def on_host(values: paddle.Tensor) -> np.ndarray:
    """``values`` (logits) on the host as numpy, a copy: cast to float32 where they are first
    when narrower (``widened``)."""
    return widened(values).numpy()


def sample_on_host(logits: np.ndarray, draws: Draws, replaced: Mapping[int, np.ndarray]) -> np.ndarray:
    """``sample_batch`` over logits on the host: ``sample`` row by row, a row with nothing to
    draw from given its raw row's argmax."""
    params = zip(draws.temperature, draws.top_k, draws.top_p, draws.min_p, draws.uniform, strict=True)
    drawn = [_sample_row(replaced.get(j, row), *p) for j, (row, p) in enumerate(zip(logits, params, strict=True))]
    tokens = [token if token >= 0 else raw_argmax(raw) for token, raw in zip(drawn, logits, strict=True)]
    return np.array(tokens, dtype=np.int64)


def sample_on_device(logits: paddle.Tensor, draws: Draws, replaced: Mapping[int, np.ndarray]) -> np.ndarray:
    """``sample_batch`` in Paddle ops where ``logits`` are; the rows in ``replaced`` uploaded into
    the batch, and one ``[B]`` copy of the tokens back."""
    logits = widened(logits)
    greedy = np.flatnonzero(draws.temperature <= 0)
    drawn = np.flatnonzero(draws.temperature > 0)
    parts = []
    if greedy.size:
        parts.append(_checked(lambda rows: paddle.argmax(rows, axis=1), logits, greedy, replaced))
    if drawn.size:
        parts.append(_checked(lambda rows: _draw(rows, draws.take(drawn)), logits, drawn, replaced))
    tokens = paddle.concat(parts) if len(parts) > 1 else parts[0]
    return tokens.numpy().astype(np.int64)[np.argsort(np.concatenate([greedy, drawn]))]


def _checked(
    pick: Callable[[paddle.Tensor], paddle.Tensor],
    logits: paddle.Tensor,
    rows: np.ndarray,
    replaced: Mapping[int, np.ndarray],
) -> paddle.Tensor:
    """``pick``'s tokens of ``rows`` (``_rows``), but for a row with nothing to draw from (a NaN,
    or a largest logit not finite) its raw row's argmax (``raw_argmax``). Any token past the
    vocabulary is clamped to its last id: a backstop, should a kernel's search run past the end.
    All on the device, no sync: a few passes over the rows, memory-bound on a GPU; Paddle's CPU
    kernels (not the CPU's path: ``sample_batch``) took a greedy batch of 32 rows of 152k from 6
    to 45 ms with them, a temperature-1 one from 135 to 182 ms."""
    chosen = _rows(logits, rows, replaced)
    tokens = pick(chosen)
    stuck = paddle.isnan(chosen).any(axis=1) | ~paddle.isfinite(chosen.max(axis=1))
    raw = _select(logits, rows)
    fallback = paddle.argmax(paddle.where(paddle.isnan(raw), paddle.full_like(raw, -math.inf), raw), axis=1)
    return paddle.where(stuck, fallback, paddle.minimum(tokens, paddle.to_tensor(raw.shape[1] - 1, dtype="int64")))


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
