"""Which GPU each worker process and DP rank that `splitbus up` starts gets (splitbus/cli/up.py,
splitbus/cli/gpus.py), with the machine's GPU count faked: no processes, the parts are recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.cli import up
from splitbus.gpu_ops import device
from tests.cli.test_up_groups import Recorded, parse


def _devices(monkeypatch: pytest.MonkeyPatch, gpus: int, *argv: str) -> dict[str, str | None]:
    """Each worker part's ``--device`` (None: none given) on a machine with ``gpus`` GPUs."""
    monkeypatch.setattr(device, "count_gpus", lambda: gpus)
    args, supervisor = parse(*argv), Recorded()
    model, counts = up.ServedModel(Path("m"), "m"), up.worker_counts(args)
    up._start_parts(supervisor, args, "redis://x", model, counts)  # type: ignore[arg-type]  # a recorder
    workers = {name: argv for name, (argv, _) in supervisor.parts.items() if argv[0] == "worker"}
    return {name: w[w.index("--device") + 1] if "--device" in w else None for name, w in workers.items()}


DISAGGREGATED = ("--engine", "paddle", "--prefill", "2", "--decode", "1", "--decode-dp", "3")


def test_each_process_and_rank_gets_its_own_gpu_round_robin_and_up_says_which(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    got = _devices(monkeypatch, 4, *DISAGGREGATED)
    assert got == {"prefill0": "gpu:0", "prefill1": "gpu:1", "d0-r0": "gpu:2", "d0-r1": "gpu:3", "d0-r2": "gpu:0"}
    said = capsys.readouterr().out.splitlines()
    assert said == ["GPUs: 4; prefill0 gpu:0, prefill1 gpu:1, d0-r0 gpu:2, d0-r1 gpu:3, d0-r2 gpu:0"]


def test_dp_ranks_and_mixed_workers_share_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _devices(monkeypatch, 2, "--engine", "paddle", "--dp", "3") == {
        "rank0": "gpu:0",
        "rank1": "gpu:1",
        "rank2": "gpu:0",
    }


@pytest.mark.parametrize(
    ("gpus", "argv"),
    [
        (0, DISAGGREGATED),  # no GPU: nothing changes
        (1, DISAGGREGATED),  # one: each worker's --device auto takes it
        (4, ("--engine", "sim", "--prefill", "2", "--decode", "1")),  # an engine without Paddle
        (4, (*DISAGGREGATED, "--worker-arg=--device=cpu")),  # the user named the device
    ],
)
def test_no_device_is_given_unless_there_are_several_gpus_to_share(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], gpus: int, argv: tuple[str, ...]
) -> None:
    assert set(_devices(monkeypatch, gpus, *argv).values()) == {None}
    assert "GPUs:" not in capsys.readouterr().out
