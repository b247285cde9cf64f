"""Choosing the device: ``--device``'s values, a GPU Paddle sees (faked: this machine has none),
bfloat16 from the compute capability, its memory, and counting GPUs without Paddle."""

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


def test_gpu_memory_is_the_total_and_what_this_process_holds_once_its_cache_is_given_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Paddle as a GPU build would answer (2.6 and 3.x alike): the reservation counted after
    ``empty_cache``, so freed blocks left by loading are not counted as held."""
    reserved = {2: 5_000}
    calls: list[str] = []

    def empty_cache() -> None:
        calls.append("empty_cache")
        reserved[2] = 3_000

    def properties(index: int) -> object:
        calls.append(f"properties {index}")
        return type("Properties", (), {"total_memory": 80_000})()

    monkeypatch.setattr(paddle.device.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(paddle.device.cuda, "get_device_properties", properties)
    monkeypatch.setattr(paddle.device.cuda, "memory_reserved", lambda index: reserved[index])
    assert device.gpu_memory("gpu:2") == (80_000, 3_000)
    assert calls == ["empty_cache", "properties 2"]
    assert device.gpu_memory("cpu") is None
    assert calls == ["empty_cache", "properties 2"]  # the CPU asks Paddle nothing


def _smi(stdout: str, code: int = 0) -> object:
    def run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        assert argv == ["nvidia-smi", "-L"]
        return subprocess.CompletedProcess(argv, code, stdout, "")

    return run


LISTED = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-b)\n"


@pytest.mark.parametrize(
    ("env", "run", "count"),
    [
        ({}, _smi(LISTED), 2),
        ({"CUDA_VISIBLE_DEVICES": "1"}, _smi(LISTED), 1),
        ({"CUDA_VISIBLE_DEVICES": "1,0,5"}, _smi(LISTED), 2),  # CUDA stops at GPU 5, which is not there
        ({"CUDA_VISIBLE_DEVICES": "0,2,3"}, _smi(LISTED * 2), 3),
        ({"CUDA_VISIBLE_DEVICES": ""}, _smi(LISTED), 0),
        ({"CUDA_VISIBLE_DEVICES": "1,-1,0"}, _smi(LISTED), 1),  # CUDA stops at -1
        ({"CUDA_VISIBLE_DEVICES": "0,,1"}, _smi(LISTED), 1),  # ... at an empty entry
        ({"CUDA_VISIBLE_DEVICES": "0,00,1"}, _smi(LISTED), 1),  # ... at a GPU given twice
        ({"CUDA_VISIBLE_DEVICES": "1,x,0"}, _smi(LISTED), 1),  # ... at neither an index nor a UUID
        ({"CUDA_VISIBLE_DEVICES": " 1 , GPU-b"}, _smi(LISTED), 2),  # a UUID is taken on trust
        ({"CUDA_VISIBLE_DEVICES": "GPU-a,MIG-c,GPU-b"}, _smi(LISTED), 2),  # but never more than are installed
        ({"CUDA_VISIBLE_DEVICES": "0"}, _smi("", code=9), 0),  # a driver that fails: no GPU to make visible
        ({}, _smi("", code=9), 0),
    ],
)
def test_gpus_are_counted_without_paddle_as_cuda_reads_the_visible_devices(
    env: dict[str, str], run: object, count: int
) -> None:
    assert device.count_gpus(env, run) == count  # type: ignore[arg-type]  # a fake run


def test_no_nvidia_smi_is_no_gpu() -> None:
    def missing(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(argv[0])

    assert device.count_gpus({}, missing) == 0
