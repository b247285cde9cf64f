"""Which GPU each worker process and DP rank that `splitbus up` starts gets, and what part of its
memory when several share it (splitbus/cli/up.py, splitbus/cli/gpus.py), with the machine's GPU
count faked: no processes, the parts are recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.cli import gpus, up
from splitbus.cli.main import build_parser
from splitbus.env import load_env
from splitbus.gpu_ops import device
from tests.cli.test_up_groups import Recorded, parse


def _workers(monkeypatch: pytest.MonkeyPatch, gpus: int, *argv: str) -> dict[str, list[str]]:
    """Each worker part's arguments on a machine with ``gpus`` GPUs."""
    monkeypatch.setattr(device, "count_gpus", lambda: gpus)
    args, supervisor = parse(*argv), Recorded()
    model, counts = up.ServedModel(Path("m"), "m"), up.worker_counts(args)
    up._start_parts(supervisor, args, "redis://x", model, counts)  # type: ignore[arg-type]  # a recorder
    return {name: argv for name, (argv, _) in supervisor.parts.items() if argv[0] == "worker"}


def _option(argv: list[str], option: str) -> str | None:
    """The value of the last ``option`` given in ``argv`` (None: none given)."""
    at = [i for i, arg in enumerate(argv) if arg == option]
    return argv[at[-1] + 1] if at else None


def _devices(monkeypatch: pytest.MonkeyPatch, gpus: int, *argv: str) -> dict[str, str | None]:
    """Each worker part's ``--device`` (None: none given) on a machine with ``gpus`` GPUs."""
    return {name: _option(w, "--device") for name, w in _workers(monkeypatch, gpus, *argv).items()}


def _fractions(monkeypatch: pytest.MonkeyPatch, gpus: int, *argv: str) -> set[str | None]:
    """The ``--gpu-memory-fraction`` values ``up`` gives its workers (None: none given)."""
    return {_option(w, "--gpu-memory-fraction") for w in _workers(monkeypatch, gpus, *argv).values()}


DISAGGREGATED = ("--engine", "paddle", "--prefill", "2", "--decode", "1", "--decode-dp", "3")


def test_each_process_and_rank_gets_its_own_gpu_round_robin_and_up_says_which(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    got = _devices(monkeypatch, 4, *DISAGGREGATED)
    assert got == {"prefill0": "gpu:0", "prefill1": "gpu:1", "d0-r0": "gpu:2", "d0-r1": "gpu:3", "d0-r2": "gpu:0"}
    said = capsys.readouterr().out.splitlines()
    assert said == [
        "GPUs: 4; prefill0 gpu:0, prefill1 gpu:1, d0-r0 gpu:2, d0-r1 gpu:3, d0-r2 gpu:0; "
        "up to 2 workers on a GPU, each --gpu-memory-fraction 0.45"
    ]


def test_dp_ranks_and_mixed_workers_share_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _devices(monkeypatch, 2, "--engine", "paddle", "--dp", "3") == {
        "rank0": "gpu:0",
        "rank1": "gpu:1",
        "rank2": "gpu:0",
    }


@pytest.mark.parametrize(
    ("gpus", "argv", "fraction", "said"),
    [
        (4, ("--engine", "paddle", "--prefill", "2", "--decode", "2"), None, "GPUs: 4; prefill0 gpu:0, "),  # alone
        (1, ("--engine", "paddle"), "0.45", "GPUs: 1; up to 2 workers on a GPU, each --gpu-memory-fraction 0.45"),
        (2, ("--engine", "paddle", "--dp", "7"), "0.225", "up to 4 workers on a GPU"),  # 7 ranks on 2 GPUs
        (1, ("--engine", "paddle", "--mixed", "7"), "0.1285", "up to 7 workers"),  # rounded down: 7 x 0.1285 <= 0.9
        (4, ("--engine", "paddle", "--worker-arg=--dev=gpu:1", "--mixed", "3"), "0.3", "GPUs: 4; up to 3 workers"),
        (2, ("--engine", "paddle", "--autoscale", "1:3", "--ttft-slo-ms", "1", "--itl-slo-ms", "1"), "0.3", "up to 3"),
        (1, ("--engine", "paddle", "--worker-arg=--gpu-mem", "--worker-arg=0.4"), None, "the --gpu-memory-fr"),
    ],
)
def test_workers_sharing_a_gpu_each_get_their_part_of_it_and_up_says_so(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    gpus: int,
    argv: tuple[str, ...],
    fraction: str | None,
    said: str,
) -> None:
    """Planned at most at once: every rank, and --autoscale's most of each role (two roles of 3 on 2 GPUs)."""
    assert _fractions(monkeypatch, gpus, *argv) == {fraction}
    assert said in capsys.readouterr().out


@pytest.mark.parametrize(
    ("gpus", "argv"),
    [
        (0, DISAGGREGATED),  # no GPU: nothing changes
        (1, ("--engine", "paddle", "--mixed", "1")),  # one worker alone on the one GPU its --device auto takes
        (4, ("--engine", "sim", "--prefill", "2", "--decode", "1")),  # an engine without Paddle
        (4, (*DISAGGREGATED, "--worker-arg=--device=cpu")),  # the user named the CPU
        (4, (*DISAGGREGATED, "--worker-arg=--devic", "--worker-arg=cpu")),  # as argparse takes it, abbreviated
    ],
)
def test_no_device_or_fraction_is_given_unless_gpus_are_there_to_share(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], gpus: int, argv: tuple[str, ...]
) -> None:
    workers = _workers(monkeypatch, gpus, *argv).values()
    assert {(_option(w, "--device"), _option(w, "--gpu-memory-fraction")) for w in workers} == {(None, None)}
    assert "GPUs:" not in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--device", "--gpu-memory-fraction"])
def test_an_abbreviation_the_worker_takes_as_the_option_is_seen_as_naming_it(option: str) -> None:
    """Every prefix of ``option`` that the worker's parser takes (argparse takes a prefix that no
    other option has) is one ``gpus.given`` reads; the prefixes it refuses as ambiguous stop the worker."""
    parser, value = build_parser(load_env({})), "gpu:1" if option == "--device" else "0.5"
    taken = []
    for end in range(3, len(option) + 1):
        prefix = option[:end]
        assert gpus.given(["--role", "mixed", f"{prefix}=x"], option) == "x"
        assert gpus.given([prefix, "y"], option) == "y"
        try:
            parsed = parser.parse_args(["worker", "--role", "mixed", "--model", "m", prefix, value])
        except SystemExit:
            continue  # ambiguous: the worker would not start
        assert str(getattr(parsed, option.removeprefix("--").replace("-", "_"))) == value
        taken.append(prefix)
    assert option[:4] in taken  # "--de" and "--gp": argparse takes them as the option
    assert gpus.given(["--dp-rank", "1", "--", "-d"], option) is None
