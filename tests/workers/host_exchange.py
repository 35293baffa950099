"""Test-only workers for tests/test_host_exchange.py (importable by name)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import refimpl.guard._host_exchange as host_exchange
from refimpl.guard import CollectiveGuard, CollectiveMismatch


def guard_path(cut_off: int, wanted: list[bool]) -> tuple[str, str]:
    """Build a guard (rank ``cut_off`` finds no peer's socket; rank r passes
    ``host_exchange=wanted[r]``); which path it took, and whether it still catches a
    mismatch (each rank names its metric after itself)."""
    rank = dist.get_rank()
    if rank == cut_off:
        host_exchange._reachable = lambda address: False  # as if on another host
    guard = CollectiveGuard(timeout_s=10.0, host_exchange=wanted[rank])
    assert guard._rows is not None
    path = guard._rows.name
    try:
        guard.all_reduce(torch.ones(2), name=f"metric/{rank}")
    except CollectiveMismatch:
        return path, "mismatch"
    return path, "no error"


def peer_leaves() -> tuple[str, str, float]:
    """Rank 1 closes its guard's socket (what its process's death does to it) and stays
    away; rank 0 calls: its error, the error of a second call, and how long the first took."""
    guard = CollectiveGuard(timeout_s=30.0)
    assert guard._rows is not None and guard._rows.name == "host"
    if dist.get_rank() == 1:
        dist.barrier()
        time.sleep(0.3)  # rank 0 is waiting by now
        guard._rows.close()
        dist.barrier()
        return "left", "", 0.0
    dist.barrier()
    errors = []
    started = time.monotonic()
    for _ in range(2):
        try:
            guard.all_reduce(torch.ones(2), name="metric")
        except CollectiveMismatch as exc:
            errors.append(str(exc))
    seconds = time.monotonic() - started
    dist.barrier()
    return errors[0], errors[1], seconds


class _Numbers(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def peer_leaves_with_forked_workers() -> tuple[str, float]:
    """As `peer_leaves`, but rank 1 first starts a DataLoader worker by ``fork`` (Linux's
    default start method before Python 3.14), which lives on after rank 1 closes its guard's
    socket: rank 0's error and how long its call took."""
    guard = CollectiveGuard(timeout_s=30.0)
    assert guard._rows is not None and guard._rows.name == "host"
    if dist.get_rank() == 1:
        loader = torch.utils.data.DataLoader(
            _Numbers(), num_workers=1, multiprocessing_context="fork", persistent_workers=True
        )
        batches = iter(loader)
        next(batches)  # the worker is running
        dist.barrier()
        time.sleep(0.3)
        guard._rows.close()
        dist.barrier()  # the worker is still alive here: rank 0 has finished its call
        del batches, loader
        return "left", 0.0
    dist.barrier()
    started = time.monotonic()
    try:
        guard.all_reduce(torch.ones(2), name="metric")
        error = "no error"
    except CollectiveMismatch as exc:
        error = str(exc)
    seconds = time.monotonic() - started
    dist.barrier()
    return error, seconds
