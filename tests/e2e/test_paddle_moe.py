"""`splitbus up` with the paddle engine and a tiny Mixtral: greedy text through a real prefill
worker, the KV hand-off over TCP and a real decode worker equals the engine's full recompute
(itself checked against a numpy reference in tests/worker/engines/paddle/test_moe.py). Kept
small: two layers, hidden 64, three prompts."""

from __future__ import annotations

import asyncio
from pathlib import Path

from splitbus.gpu_ops import device

device.prepare()

from splitbus.worker.engines.paddle.tiny import make_tiny_model  # noqa: E402
from tests.e2e import greedy  # noqa: E402
from tests.e2e.conftest import start_system, stop_system  # noqa: E402

NEW = 8


PROMPTS = greedy.prompts(12, (1, 17, 40))


def test_mixtral_greedy_text_through_p_and_d_workers_matches_the_recompute(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tiny", "mixtral", seed=5, hidden=64, layers=2)
    reference = greedy.reference(model_dir, PROMPTS, NEW)
    assert all(reference)  # a text per prompt: the comparison below has something to compare
    system = start_system(tmp_path / "up", "--engine", "paddle", "--model", str(model_dir))
    try:
        assert asyncio.run(greedy.ask_all(system.v1, PROMPTS, NEW)) == reference
    finally:
        assert stop_system(system) == []
