"""Expert parallelism over real processes: 2 and 4 ranks, each holding its share of the experts,
forming a gloo group on loopback and running forwards in lock-step, against one model that holds
every expert (itself checked against a numpy reference in tests/worker/engines/paddle/test_moe.py)."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitbus.gpu_ops.expert_parallel import expert_shard
from splitbus.worker.engines.paddle.model import Chunk, Experts, load_model
from splitbus.worker.engines.paddle.tiny import make_tiny_model

STEPS = 3


def _prompts(rank: int, step: int) -> list[list[int]]:
    """Rank ``rank``'s sequences in ``step``: a different mix per rank and step; rank 1 idles
    (one dummy token, as the engine's idle forward) in step 1."""
    if _idle(rank, step):
        return [[0]]
    rng = np.random.default_rng([rank, step])
    return [list(rng.integers(1, 200, int(rng.integers(1, 9)))) for _ in range(1 + (rank + step) % 3)]


def _idle(rank: int, step: int) -> bool:
    return rank == 1 and step == 1


def _rank(folder: str, port: int, rank: int, size: int, out: Any) -> None:
    from splitbus.gpu_ops.expert_parallel import ExpertGroup, Rendezvous

    model = load_model(Path(folder), (rank, size))
    model.group = ExpertGroup.form(Rendezvous("127.0.0.1", port, rank, size, 30))
    for step in range(STEPS):
        logits = model.forward([Chunk(p, 0) for p in _prompts(rank, step)], counted=not _idle(rank, step))
        out.put((rank, step, logits, model.expert_tokens.copy(), sorted(next(_moe(model)).experts)))


def _waiting_rank(folder: str, port: int, rank: int, out: Any) -> None:
    """Rank 0 runs a forward, whose first exchange waits for rank 1; rank 1 forms and never does."""
    import os
    import time

    from splitbus.gpu_ops.expert_parallel import ExpertGroup, Rendezvous

    model = load_model(Path(folder), (rank, 2))
    model.group = ExpertGroup.form(Rendezvous("127.0.0.1", port, rank, 2, 30))
    out.put((rank, os.getpid()))
    if rank == 1:
        time.sleep(120)
        return
    try:
        model.forward([Chunk([1, 2, 3], 0)])
        out.put("returned")
    except Exception as exc:  # what the worker's stepper turns into a broken group
        out.put(f"raised {type(exc).__name__}: {exc}")


BF16_TOKENS = (3, 5)
"""Each rank's tokens in the bf16 exchange: unequal, so that rank 0's are padded."""


def _bf16_part(rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank ``rank``'s tokens for the bf16 exchange: hidden states and weights (float32 values
    a bf16 holds exactly) and expert ids past 256, where bf16 stops holding integers exactly."""
    rng = np.random.default_rng(rank)
    n = BF16_TOKENS[rank]
    h = rng.integers(-128, 128, (n, 8)).astype(np.float32) / 64
    ids = rng.choice(np.arange(250, 1000), (n, 2), replace=False) + rank
    return h, ids.astype(np.int64), rng.integers(1, 128, (n, 2)).astype(np.float32) / 128


def _bf16_rank(port: int, rank: int, out: Any) -> None:
    """Dispatch and combine a bf16 hidden state (what a bf16 model's MoE layer exchanges)."""
    import paddle

    from splitbus.gpu_ops.expert_parallel import ExpertGroup, Rendezvous
    from splitbus.gpu_ops.moe import Routing

    group = ExpertGroup.form(Rendezvous("127.0.0.1", port, rank, 2, 30))
    group.begin(BF16_TOKENS[rank])
    h, ids, weights = _bf16_part(rank)
    every, routing = group.dispatch(
        paddle.to_tensor(h).astype("bfloat16"), Routing(ids, paddle.to_tensor(weights).astype("bfloat16")), 1001
    )
    outputs = paddle.zeros([sum(BF16_TOKENS), 2, 8], dtype="bfloat16")
    outputs[:, rank] = every  # slot ``rank`` of every token is this rank's: one holder a slot
    mine = group.combine(outputs)
    dtypes = (str(every.dtype), str(routing.weights.dtype), str(mine.dtype))
    out.put(
        (
            rank,
            dtypes,
            every.astype("float32").numpy(),
            routing.experts,
            routing.weights.astype("float32").numpy(),
            mine.astype("float32").numpy(),
        )
    )


def test_a_bf16_hidden_state_and_expert_ids_past_256_cross_the_exchange_exactly() -> None:
    """The exchange packs ids with the state: in bf16 id 257 would come back 256. Gloo (the CPU's
    backend) carries what a bf16 model's MoE layer sends; the results keep their dtypes."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    ranks = [context.Process(target=_bf16_rank, args=(port, r, out)) for r in range(2)]
    for p in ranks:
        p.start()
    got = dict((rank, rest) for rank, *rest in (out.get(timeout=120) for _ in range(2)))
    for p in ranks:
        p.join(30)
        assert p.exitcode == 0
    parts = [_bf16_part(r) for r in range(2)]
    h, ids, weights = (np.concatenate([part[i] for part in parts]) for i in range(3))
    assert ids.max() > 256 and np.any(ids % 2 == 1)  # ids a bf16 would round
    for rank in range(2):
        dtypes, every, experts, routed, mine = got[rank]
        assert dtypes == ("paddle.bfloat16",) * 3
        np.testing.assert_array_equal(every, h)
        np.testing.assert_array_equal(experts, ids)
        np.testing.assert_array_equal(routed, weights)
        np.testing.assert_array_equal(mine, np.stack([parts[rank][0]] * 2, axis=1))


def _moe(model: Any) -> Any:
    return (layer.mlp for layer in model.layers if isinstance(layer.mlp, Experts))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param, seed=4, hidden=64, layers=2)


def test_an_expert_share_is_contiguous_and_covers_every_expert_once() -> None:
    assert [list(expert_shard(8, r, 3)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [e for r in range(4) for e in expert_shard(4, r, 4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="at least as many experts"):
        expert_shard(4, 0, 8)


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_holding_a_share_of_the_experts_compute_what_one_model_holding_all_does(moe_dir: Path, size: int) -> None:
    whole = load_model(moe_dir)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    ranks = [context.Process(target=_rank, args=(str(moe_dir), port, r, size, out)) for r in range(size)]
    for p in ranks:
        p.start()
    got = {(rank, step): rest for rank, step, *rest in (out.get(timeout=120) for _ in range(size * STEPS))}
    for p in ranks:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(e for r in range(size) for e in got[(r, 0)][2]) == list(range(whole.config.experts.count))  # type: ignore[union-attr]
    for step in range(STEPS):
        group_tokens = np.zeros_like(whole.expert_tokens)
        for rank in range(size):
            logits, _, held = got[(rank, step)]
            assert held == list(expert_shard(len(group_tokens), rank, size))
            expected = whole.forward([Chunk(p, 0) for p in _prompts(rank, step)])
            np.testing.assert_allclose(logits, expected, atol=1e-5)
            assert (logits.argmax(-1) == expected.argmax(-1)).all()
            if not _idle(rank, step):  # an idle forward's dummy token is in no expert's load
                group_tokens += whole.expert_tokens
        for rank in range(size):  # every rank counted the group's tokens per expert
            np.testing.assert_array_equal(got[(rank, step)][1], group_tokens)
        assert group_tokens.sum() > 0


def test_a_rank_killed_while_another_waits_in_an_exchange_makes_its_forward_raise(moe_dir: Path) -> None:
    """Deterministic: rank 0 is inside its forward's first exchange (rank 1 never joins) when
    rank 1 is killed; rank 0's forward raises (gloo: the pair's socket closed) instead of hanging."""
    import os
    import signal

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    ranks = [context.Process(target=_waiting_rank, args=(str(moe_dir), port, r, out)) for r in range(2)]
    for p in ranks:
        p.start()
    pids = dict(out.get(timeout=120) for _ in range(2))
    ranks[0].join(1.0)  # rank 0 now waits in the exchange
    assert ranks[0].is_alive()
    os.kill(pids[1], signal.SIGKILL)
    said = out.get(timeout=25)  # before gloo's own 30 s timeout: the peer's socket closed
    assert said.startswith("raised RuntimeError: [/paddle/third_party/gloo/"), said
    ranks[0].join(30)
    assert ranks[0].exitcode == 0
