"""Expert parallelism end to end: `splitbus up --engine paddle --ep` with a prefill group and a
decode group, each of 2 or 4 ranks holding a share of a tiny MoE model's experts (gloo on
loopback, formed through `sb:ep:{group}`). Greedy text through P group -> KV over TCP -> D group
equals the engine's full recompute on one model holding every expert (itself checked against a
numpy reference in tests/worker/engines/paddle/test_moe.py). Kept small: two layers, hidden 64."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from splitbus.gpu_ops import device

device.prepare()

from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from tests.e2e import greedy  # noqa: E402
from tests.e2e.conftest import start_system, stop_system  # noqa: E402

NEW = 8
PROMPTS = greedy.prompts(13, (1, 9, 17, 40, 5, 23))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("arch", "ranks"), [("mixtral", 2), ("qwen3_moe", 2), ("mixtral", 4)])
def test_greedy_text_through_expert_parallel_p_and_d_groups_matches_one_model(
    tmp_path: Path, arch: str, ranks: int
) -> None:
    model_dir = make_tiny_model(tmp_path / "tiny", arch, seed=5, hidden=64, layers=2)
    reference = greedy.reference(model_dir, PROMPTS, NEW)
    assert all(reference)
    groups = ("--prefill-dp", str(ranks), "--decode-dp", str(ranks), "--ep")
    system = start_system(tmp_path / "up", "--engine", "paddle", "--model", str(model_dir), *groups)
    try:
        assert asyncio.run(greedy.ask_all(system.v1, PROMPTS, NEW)) == reference
        for group in ("p0", "d0"):
            system.wait_output(rf"^{group}-r0 .*DP group {group}: expert-parallel group formed", 5)
        last = ranks - 1
        system.wait_output(rf"^p0-r{last} .*rank {last} of {ranks} holds experts {last * 4 // ranks}-", 5)
    finally:
        assert stop_system(system) == []
