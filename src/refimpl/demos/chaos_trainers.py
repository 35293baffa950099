"""Chapter 10: small trainers for `refimpl.chaos`, one correct and two that resume wrong.

::

    torchrun --standalone --nproc-per-node=2 --max-restarts=2 \\
        -m refimpl.demos.chaos_trainers --variant ok --out OUT

A DDP MLP with dropout (so the RNG streams are part of the state), a `ResumableSampler`, and
`refimpl.checkpoint` under ``OUT/ckpt``; rank 0 writes ``OUT/final.pt`` (the weights and the
step) at the end. Every start resumes from `load_latest`. The variants:

- ``ok``: restores weights, optimizer, every rank's RNG and the sampler's position;
- ``no-rng``: leaves the RNG out, so dropout after a resume draws masks the reference did not;
- ``no-sampler``: leaves the sampler's position out, so a resume replays the epoch's start.

Rank 0 prints ``step N loss X`` after each step, ``saving step N`` as a checkpoint starts and
``resumed from step N`` on a resume: the lines `refimpl.chaos` kills on.
"""

from __future__ import annotations

# ruff: noqa: E402 -- the collector is paused (below) before torch is imported
from refimpl import _startup_gc

_startup_gc.pause(__name__)  # each (re)start: 1.8 CPU-seconds instead of 2.6 (the module says why)

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.atomic import atomic_save
from refimpl.checkpoint import load_latest, save_checkpoint
from refimpl.data import ResumableBatches, ResumableSampler
from refimpl.launch import init_from_env
from refimpl.state import capture_rng, capture_state, restore_state, unwrap_state_dict

__all__ = ["VARIANTS", "main"]

VARIANTS = ("ok", "no-rng", "no-sampler")
"""What each trainer restores on a resume (everything; all but the RNG; all but the sampler)."""


def _resume(
    args: argparse.Namespace,
    model: DDP,
    opt: torch.optim.Optimizer,
    sampler: ResumableSampler,
    rank: int,
) -> int:
    """Load the newest good checkpoint (minus what the variant forgets); return its step."""
    found = load_latest(os.path.join(args.out, "ckpt"))
    if found is None:
        return 0
    state = dict(found[1])
    if args.variant == "no-rng":
        state["rng"] = None  # the bug: dropout restarts from the seed's stream
    info = restore_state(state, model, opt, rank=rank, world_size=dist.get_world_size())
    if args.variant != "no-sampler":  # the bug: the epoch starts over from its first batch
        sampler.load_state_dict(info["sampler"])
    if rank == 0:
        print(f"resumed from step {info['step']}", flush=True)
    return int(info["step"])


def main(argv: Sequence[str] | None = None) -> int:
    """Train ``--steps`` steps as ``--variant`` says, resuming from ``OUT/ckpt``."""
    p = argparse.ArgumentParser(prog="python -m refimpl.demos.chaos_trainers")
    p.add_argument("--variant", choices=VARIANTS, default="ok")
    p.add_argument("--out", required=True, help="checkpoints and final.pt go here")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.05, help="time for a kill to land")
    args = p.parse_args(argv)
    info = init_from_env(timeout_s=30)
    rank, world = info.rank, info.world_size
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
    )
    model = DDP(net)
    _startup_gc.resume()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(40, 8, generator=g)  # 40 samples, 8 per global batch: 5 steps an epoch
    y = x.sum(1, keepdim=True).sin()
    sampler = ResumableSampler(len(x), batch_size=4, rank=rank, world_size=world, seed=args.seed)
    torch.manual_seed(args.seed + 100 * (rank + 1))  # this rank's own dropout stream
    step = _resume(args, model, opt, sampler, rank)
    batches = ResumableBatches(sampler)
    while step < args.steps:
        idx = torch.tensor(next(batches)[1])
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        step += 1
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            rngs: list[Any] = [None] * world
            dist.all_gather_object(rngs, capture_rng())  # every rank's stream, not rank 0's
            if rank == 0:
                print(f"saving step {step}", flush=True)
                state = capture_state(
                    model,
                    opt,
                    sampler_state=batches.state_dict(),
                    rng=rngs,
                    step=step,
                    world_size=world,
                )
                save_checkpoint(os.path.join(args.out, "ckpt"), state, step)
            dist.barrier()  # nobody runs ahead of a save that may yet fail
        time.sleep(args.step_sleep)
    if rank == 0:
        atomic_save(
            {"model": unwrap_state_dict(model), "step": step}, os.path.join(args.out, "final.pt")
        )
        print(f"done: {step} steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
