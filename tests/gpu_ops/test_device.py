"""Choosing the device: ``--device``'s values, a GPU Paddle sees (faked: this machine has none),
bfloat16 from the compute capability, free memory, and counting GPUs without Paddle."""

from __future__ import annotations

import subprocess

import paddle
import pytest

from splitbus.gpu_ops import device


@pytest.mark.parametrize("text", ["auto", "cpu", "gpu:0", "gpu:12"])
def test_the_device_names_a_worker_takes(text: str) -> None:
    assert device.parse_device(text) == text


@pytest.mark.parametrize("text", ["", "gpu", "gpu:", "gpu:-1", "gpu:01", "cuda:0", "GPU:0", "gpu:1 "])
def test_other_device_names_are_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match=r"device must be auto, cpu or gpu:N"):
        device.parse_device(text)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paddle as a CUDA build that sees two GPUs would be; the devices set, recorded."""
    chosen: list[str] = []
    monkeypatch.setattr(paddle.device, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(paddle, "set_device", chosen.append)
    return chosen


@pytest.mark.parametrize(("spec", "where"), [("auto", "gpu:0"), ("gpu:1", "gpu:1"), ("cpu", "cpu")])
def test_a_gpu_paddle_sees_is_taken_as_asked(two_gpus: list[str], spec: str, where: str) -> None:
    assert device.select_device(1, spec) == where
    assert two_gpus == [where]


def test_a_gpu_paddle_does_not_see_is_a_clear_error(two_gpus: list[str]) -> None:
    with pytest.raises(ValueError, match=r"--device gpu:2: Paddle sees 2 GPU\(s\) here$"):
        device.select_device(1, "gpu:2")
    assert two_gpus == []


def test_without_a_gpu_auto_is_the_cpu_and_a_gpu_is_refused() -> None:
    assert device.select_device(1, "auto") == "cpu"  # this machine: a CPU build of Paddle
    with pytest.raises(ValueError, match=r"Paddle sees 0 GPU\(s\) here \(a CPU build\?\)"):
        device.select_device(1, "gpu:0")


@pytest.mark.parametrize(("capability", "bf16"), [((8, 0), True), ((9, 0), True), ((7, 5), False), ((6, 1), False)])
def test_bf16_from_compute_capability_8(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], bf16: bool
) -> None:
    asked: list[int] = []
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda i: asked.append(i) or capability)
    assert device.computes_bf16("gpu:1") is bf16
    assert asked == [1]
    assert device.computes_bf16("cpu") is False  # never asks Paddle: no bf16 matmul on the CPU
    assert asked == [1]


def test_free_memory_is_the_drivers_count_on_a_gpu_and_none_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paddle.cuda, "mem_get_info", lambda i: (3_000 + i, 80_000))
    assert device.free_bytes("gpu:2") == 3_002
    assert device.free_bytes("cpu") is None


def _smi(stdout: str, code: int = 0) -> object:
    def run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        assert argv == ["nvidia-smi", "-L"]
        return subprocess.CompletedProcess(argv, code, stdout, "")

    return run


LISTED = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-b)\n"


@pytest.mark.parametrize(
    ("env", "run", "count"),
    [
        ({"CUDA_VISIBLE_DEVICES": "0,2,3"}, _smi(LISTED), 3),  # the variable wins over the listing
        ({"CUDA_VISIBLE_DEVICES": ""}, _smi(LISTED), 0),
        ({"CUDA_VISIBLE_DEVICES": "1,-1,0"}, _smi(LISTED), 1),  # CUDA stops at -1
        ({}, _smi(LISTED), 2),
        ({}, _smi("", code=9), 0),  # a driver that fails
    ],
)
def test_gpus_are_counted_without_paddle(env: dict[str, str], run: object, count: int) -> None:
    assert device.count_gpus(env, run) == count  # type: ignore[arg-type]  # a fake run


def test_no_nvidia_smi_is_no_gpu() -> None:
    def missing(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(argv[0])

    assert device.count_gpus({}, missing) == 0
