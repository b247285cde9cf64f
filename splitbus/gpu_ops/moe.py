"""A mixture-of-experts MLP in three steps, so that expert parallelism runs the middle one on each
rank for its own experts: ``route`` (each token's top-k experts and their weights),
``run_experts`` (for each token and each of its k slots, the weighted output of the slot's
expert when this worker holds it, else zero) and ``combine`` (the partial outputs of disjoint
sets of experts added, then each token's k slots summed). One worker holding every expert runs
all three in turn (the paddle engine's ``Experts`` layer); ``splitbus.gpu_ops.expert_parallel`` runs them over a group.

A slot's output is written by exactly one holder and is zero everywhere else, so adding the
partials (or all-reducing them over ranks) is exact, and the sum over the k slots runs in the
same order on one worker and across a group: the combine adds nothing that depends on how the
experts are split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from splitbus.gpu_ops.layers import silu_and_mul


@dataclass(frozen=True)
class Expert:
    """One expert's gated MLP, in matmul layout."""

    w_gate_up: paddle.Tensor
    """``[hidden, 2 * width]``: gate and up fused."""
    w_down: paddle.Tensor
    """``[width, hidden]``."""


@dataclass(frozen=True)
class Routing:
    """Where each of a step's tokens goes: its top-k experts and their weights."""

    experts: np.ndarray
    """``[tokens, k]`` expert ids (numpy: which rows go to which expert is decided on the host)."""
    weights: paddle.Tensor
    """``[tokens, k]`` the routing weights of those experts."""


def route(h: paddle.Tensor, w_router: paddle.Tensor, k: int, renormalise: bool) -> Routing:
    """Softmax over every expert's router logit, then the top ``k``; their weights divided by
    their sum when ``renormalise`` (as Hugging Face's Mixtral and Qwen3-MoE do it)."""
    probs = F.softmax(paddle.matmul(h, w_router), axis=-1)
    weights, experts = paddle.topk(probs, k, axis=-1)
    if renormalise:
        weights = weights / paddle.sum(weights, axis=-1, keepdim=True)
    return Routing(experts.numpy(), weights)


def gated_mlp(
    h: paddle.Tensor, mlp: Expert, swiglu: Callable[[paddle.Tensor], paddle.Tensor] = silu_and_mul
) -> paddle.Tensor:
    """A SwiGLU MLP: ``down(silu(gate(h)) * up(h))`` (a dense layer's, or one expert's);
    ``swiglu``: the activation's kernel (``Kernels.swiglu``)."""
    return paddle.matmul(swiglu(paddle.matmul(h, mlp.w_gate_up)), mlp.w_down)


def run_experts(
    h: paddle.Tensor,
    routing: Routing,
    experts: Mapping[int, Expert],
    swiglu: Callable[[paddle.Tensor], paddle.Tensor] = silu_and_mul,
) -> paddle.Tensor:
    """``[tokens, k, hidden]``: for each token's k slots, the weighted output of the slot's expert
    when ``experts`` (id -> expert) holds it; zero for a slot whose expert it does not hold.
    ``swiglu``: the experts' activation kernel (``Kernels.swiglu``)."""
    tokens, k = routing.experts.shape
    out = paddle.zeros([tokens * k, h.shape[-1]], dtype=h.dtype)
    for expert_id, expert in experts.items():
        rows, slots = np.nonzero(routing.experts == expert_id)
        if rows.size == 0:
            continue
        flat = paddle.to_tensor(rows * k + slots)
        weight = paddle.index_select(routing.weights.reshape([-1]), flat).reshape([-1, 1])
        # Each (token, slot) has one expert: adding into zeros writes it, exactly.
        out = paddle.index_add(
            out, flat, 0, gated_mlp(paddle.index_select(h, paddle.to_tensor(rows)), expert, swiglu) * weight
        )
    return out.reshape([tokens, k, -1])


def combine(partials: Sequence[paddle.Tensor]) -> paddle.Tensor:
    """``[tokens, hidden]``: the MoE output from the ``run_experts`` outputs of disjoint sets of
    experts that cover every slot."""
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return paddle.sum(total, axis=1)


def tally(routing: Routing, counts: np.ndarray, rows: np.ndarray | None = None) -> None:
    """Add to ``counts`` (one per expert) the tokens routed to each expert; only those of the
    tokens ``rows`` (a boolean mask) marks, when given."""
    experts = routing.experts if rows is None else routing.experts[rows]
    counts += np.bincount(experts.ravel(), minlength=counts.size)[: counts.size]
