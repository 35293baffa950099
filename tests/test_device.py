"""rank_device: CPU under gloo, cuda:LOCAL_RANK under a CUDA backend (checked on CPU by faking
the GPU count), and a clear error when a node has fewer GPUs than local ranks."""

from __future__ import annotations

import pytest
import torch

from refimpl.device import backend_uses_cuda, rank_device
from refimpl.launch import spawn


@pytest.mark.parametrize(
    ("backend", "cuda"),
    [("gloo", False), ("nccl", True), ("cpu:gloo,cuda:nccl", True), ("mpi", False)],
)
def test_backend_uses_cuda(backend: str, cuda: bool) -> None:
    assert backend_uses_cuda(backend) is cuda


def test_gloo_gives_the_cpu_whatever_the_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device("gloo") == torch.device("cpu")


def test_nccl_gives_cuda_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert rank_device("nccl") == torch.device("cuda", 5)
    monkeypatch.delenv("LOCAL_RANK")
    assert rank_device("nccl") == torch.device("cuda", 0)


def test_no_group_picks_what_init_from_env_would(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device() == torch.device("cuda", 1)


def test_too_few_gpus_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2.*has 2"):
        rank_device("nccl")


def test_inside_spawned_gloo_ranks_every_rank_is_on_the_cpu() -> None:
    assert spawn(rank_device, 2, timeout_s=60) == [torch.device("cpu")] * 2
