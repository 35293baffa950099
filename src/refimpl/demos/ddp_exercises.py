"""Chapter 2's exercises: two of DDP's rules broken on purpose, each as a worker to spawn.

`train_without_broadcast` skips the construction-time broadcast of rank 0's weights (as if
the line in `refimpl.ddp` were commented out); `no_sync_on_one_rank` lets only rank 0 skip
the all-reduce of its first micro-step. Both return plain data, so the notebook compares
the ranks' results after they have finished, without a collective of its own that would
pair with the mismatched ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from refimpl import ddp as ddp_module
from refimpl.ddp import MiniDDP
from refimpl.demos.ddp import _batch, make_mlp

__all__ = ["no_sync_on_one_rank", "train_without_broadcast"]


def _fingerprint(model: nn.Module) -> str:
    """The first 12 hex digits of a SHA-256 of every parameter's bytes."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:12]


def train_without_broadcast(steps: int = 3, broadcast: bool = False) -> list[float]:
    """Worker: each rank builds its MLP from its own seed, wraps it in `MiniDDP` and takes
    ``steps`` SGD steps on its own data. With ``broadcast=False`` the construction-time
    broadcast of rank 0's weights is skipped (``refimpl.ddp.broadcast_state`` patched to do
    nothing). Returns the largest difference between this rank's parameters and rank 0's,
    before training and after each step (rounded to 4 decimals)."""
    skip = mock.patch.object(ddp_module, "broadcast_state", lambda module: None)
    with contextlib.nullcontext() if broadcast else skip:
        model = MiniDDP(make_mlp(seed=dist.get_rank()), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def gap() -> float:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        rank0 = flat.clone()
        dist.broadcast(rank0, src=0)
        return round(float((flat - rank0).abs().max()), 4)

    gaps = [gap()]
    for step in range(steps):
        model(_batch(step, 0)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        gaps.append(gap())
    return gaps


def no_sync_on_one_rank(
    steps: int = 2, micro_steps: int = 2, hold_s: float = 3.0
) -> dict[str, Any]:
    """Worker: gradient accumulation over ``micro_steps`` where only rank 0 runs the first
    micro-steps inside ``no_sync()``; the other ranks synchronise every micro-step.

    Returns the number of all-reduces this rank launched, a fingerprint of its parameters
    after each optimizer step it completed, and how it ended: ``"finished"`` or the first
    sentence of its error. Rank 0 stays alive ``hold_s`` seconds after finishing, so that a
    rank still waiting for a partner ends by the collective timeout, as it would in a job
    where rank 0 went on to other work.
    """
    rank = dist.get_rank()
    model = MiniDDP(make_mlp(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    launched, fingerprints, ended = 0, [], "finished"
    try:
        for step in range(steps):
            for micro in range(micro_steps):
                local = rank == 0 and micro < micro_steps - 1
                with model.no_sync() if local else contextlib.nullcontext():
                    model(_batch(step, micro)).pow(2).mean().backward()
                launched += len(model.futures)
            opt.step()
            opt.zero_grad()
            fingerprints.append(_fingerprint(model))
    except RuntimeError as exc:
        ended = str(exc).split(". ")[0]
    if rank == 0:
        time.sleep(hold_s)
    return {
        "all-reduces launched": launched,
        "params after each step": fingerprints,
        "ended": ended,
    }
