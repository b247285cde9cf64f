"""A mixture-of-experts MLP in three steps, so that expert parallelism can later run the middle
one on each rank for its own experts: ``route`` (each token's top-k experts and their weights),
``run_experts`` (the outputs of some experts for the tokens routed to them, weighted, summed per
token) and ``combine`` (the sum of those partial outputs). One worker holding every expert runs
all three in turn (``moe_mlp``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F


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


def gated_mlp(h: paddle.Tensor, mlp: Expert) -> paddle.Tensor:
    """A SwiGLU MLP: ``down(silu(gate(h)) * up(h))`` (a dense layer's, or one expert's)."""
    gate, up = paddle.split(paddle.matmul(h, mlp.w_gate_up), 2, axis=-1)
    return paddle.matmul(F.silu(gate) * up, mlp.w_down)


def run_experts(h: paddle.Tensor, routing: Routing, experts: Mapping[int, Expert]) -> paddle.Tensor:
    """``[tokens, hidden]``: each token's outputs of those of ``experts`` (id -> expert) it is
    routed to, weighted; zero for a token routed to none of them."""
    out = paddle.zeros_like(h)
    for expert_id, expert in experts.items():
        rows, slots = np.nonzero(routing.experts == expert_id)
        if rows.size == 0:
            continue
        index = paddle.to_tensor(rows)
        flat = paddle.to_tensor(rows * routing.experts.shape[1] + slots)
        weight = paddle.index_select(routing.weights.reshape([-1]), flat).reshape([-1, 1])
        out = paddle.index_add(out, index, 0, gated_mlp(paddle.index_select(h, index), expert) * weight)
    return out


def combine(partials: Sequence[paddle.Tensor]) -> paddle.Tensor:
    """The MoE output from the partial outputs of disjoint sets of experts that cover them all."""
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total


def moe_mlp(
    h: paddle.Tensor, w_router: paddle.Tensor, experts: Mapping[int, Expert], k: int, renormalise: bool
) -> paddle.Tensor:
    """The whole MoE MLP on one worker that holds every expert."""
    return combine([run_experts(h, route(h, w_router, k, renormalise), experts)])
