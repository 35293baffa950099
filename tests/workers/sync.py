"""Test-only workers for tests/test_sync.py (importable by name, as spawn requires)."""

from __future__ import annotations

import torch.distributed as dist

from refimpl.sync import MainProcessFailed, barrier_safe, main_process_first


def what_each_rank_sees_when_rank0_fails() -> str:
    try:
        with main_process_first(timeout_s=30) as is_main:
            if is_main:
                raise ValueError("rank 0 broke while preparing")
        return "no error"
    except MainProcessFailed:
        return "MainProcessFailed"
    except ValueError:
        return "ValueError"


def single_rank_helpers() -> tuple[int, bool]:
    barrier_safe(timeout_s=5, monitored=True)  # world size 1: nothing to wait for
    with main_process_first() as is_main:
        return dist.get_world_size(), is_main


def hammer_one_file(path: str, rounds: int) -> int:
    """Every rank atomically saves its own state to the SAME path, over and over: the VRT
    trainer's "save ahead of time" point (chapter 4), where every rank saved. Returns the
    rounds done."""
    import torch

    from refimpl.atomic import atomic_save

    rank = dist.get_rank()
    for i in range(rounds):
        atomic_save({"rank": rank, "i": i, "w": torch.full((50_000,), float(rank))}, path)
    return rounds


def evaluate_inside_main_process_first(bare: bool) -> str:
    """One DDP training step of a model with buffers (BatchNorm), then rank 0 alone
    evaluates inside `main_process_first`, through the DDP wrapper or (``bare``) through
    `refimpl.state.unwrap_model`. DDP's first forward after a training step broadcasts the
    buffers: a collective only rank 0 calls."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from refimpl.state import unwrap_model

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    ddp(torch.randn(8, 4)).sum().backward()
    with main_process_first(timeout_s=60) as is_main:
        if is_main:
            with torch.no_grad():
                (unwrap_model(ddp) if bare else ddp)(torch.randn(8, 4))
    return "evaluated"
