"""Chapter 10: a trainer written as a reader would, from refimpl's pieces, for the kill test.

::

    torchrun --standalone --nproc-per-node=2 --max-restarts=2 \\
        -m refimpl.demos.reader_trainer --out OUT

DDP with dropout (so every rank's RNG stream is part of the state), a `ResumableSampler`,
and `refimpl.checkpoint` under ``OUT/ckpt``; every start resumes from `load_latest`, and rank
0 writes ``OUT/final.pt`` (the weights) at the end. Rank 0 prints ``step N loss X`` after each
step and ``saving step N`` before each save: the lines ``python -m refimpl.chaos`` kills on.
Chapter 10 shows this file, runs the kill test on it, then on a copy without the one line
that saves every rank's RNG (``rng=rngs,``), which the kill test catches.

Unlike `refimpl.demos.chaos_trainers` it has no switches: it is the plain script a reader
copies (run it by path from a folder of its own, or with ``-m`` as above).
"""

from __future__ import annotations

import argparse
import itertools
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
from refimpl.data import ResumableSampler
from refimpl.launch import init_from_env
from refimpl.state import capture_rng, capture_state, restore_state, unwrap_state_dict

__all__ = ["SAVE_EVERY", "STEPS", "main"]

STEPS = 12
"""Optimizer steps in all (a restart trains only the steps after its checkpoint)."""
SAVE_EVERY = 4
"""A checkpoint every this many steps."""


def main(argv: Sequence[str] | None = None) -> int:
    """Train `STEPS` steps on every rank, resuming from ``OUT/ckpt``; returns 0.

    Raises what the process group, the checkpoint or the filesystem raise (an unreadable
    ``--out`` among them): a kill test wants the failure, not a retry.
    """
    parser = argparse.ArgumentParser(description="A resumable DDP trainer (chapter 10).")
    parser.add_argument("--out", required=True, help="checkpoints and final.pt go here")
    args = parser.parse_args(argv)
    ckpt = os.path.join(args.out, "ckpt")

    me = init_from_env(timeout_s=30)  # safe across torchrun's restarts
    rank, world = me.rank, me.world_size
    torch.manual_seed(0)  # the same initial weights on every rank
    nn = torch.nn
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))
    model = DDP(mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True).sin()
    sampler = ResumableSampler(len(x), batch_size=4, rank=rank, world_size=world, seed=0)
    torch.manual_seed(100 + rank)  # each rank its own dropout masks

    step = 0
    if (found := load_latest(ckpt)) is not None:
        resumed = restore_state(found[1], model, opt, rank=rank, world_size=world)
        sampler.load_state_dict(resumed["sampler"])
        step = resumed["step"]
        if rank == 0:
            print(f"resumed from step {step}", flush=True)

    while step < STEPS:
        batches = iter(sampler)
        while step < STEPS and len(batch := list(itertools.islice(batches, 4))) == 4:
            idx = torch.tensor(batch)
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            step += 1
            if rank == 0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)
            if step % SAVE_EVERY == 0:
                rngs: list[Any] = [None] * world
                dist.all_gather_object(rngs, capture_rng())  # every rank's stream
                if rank == 0:
                    print(f"saving step {step}", flush=True)
                    state = capture_state(
                        model,
                        opt,
                        sampler_state=sampler.state_dict(),
                        rng=rngs,
                        step=step,
                        world_size=world,
                    )
                    save_checkpoint(ckpt, state, step)
                dist.barrier()
            time.sleep(0.05)  # a toy step is short: time for a kill to land on its line
        sampler.set_epoch(sampler.epoch + 1)

    if rank == 0:
        atomic_save({"model": unwrap_state_dict(model)}, os.path.join(args.out, "final.pt"))
        print("done", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
