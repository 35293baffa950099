"""A tiny trainer written the way MiniMind's training scripts are (self-written, no code
copied), for the kill-test tests: its own ``init_process_group``, a ``DataLoader`` with two
worker processes over a ``DistributedSampler``, ``setup_seed(42 + epoch)`` at the start of
each epoch, and a resume (from ``OUT/ckpt.pth``) that skips the batches the epoch already
trained.

    torchrun --standalone --nproc-per-node=2 --max-restarts=2 \\
        tests/workers/chaos_minimind_style.py \\
        --out OUT [--fixed]

The per-epoch reseed overwrites the RNG state a resume restored: dropout after a mid-epoch
resume then draws the epoch's first masks again. ``--fixed`` restores every rank's saved RNG
state after the reseed (and after the loader's iterator has drawn its base seed, as it did
in the uninterrupted run). Prints ``samples: RANK STEP i,j,...`` for each batch it trains.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def setup_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class PretrainDataset(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, n: int = 32) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(5))
        self.y = self.x.sum(1, keepdim=True).cos()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--fixed", action="store_true")
    args = p.parse_args()
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist.init_process_group(backend="gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    setup_seed(42)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    ckpt_path = os.path.join(args.out, "ckpt.pth")
    start_epoch, start_step, rngs = 0, 0, None
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, start_step, rngs = ckpt["epoch"], ckpt["step"], ckpt["rng"]
        if rank == 0:
            print(f"resuming from epoch {start_epoch} step {start_step}", flush=True)
    net = DistributedDataParallel(model) if ddp else model
    ds = PretrainDataset()
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
    for epoch in range(start_epoch, args.epochs):
        setup_seed(42 + epoch)
        sampler.set_epoch(epoch)
        batches = iter(loader)  # draws the workers' base seed from the global RNG
        if args.fixed and rngs is not None and epoch == start_epoch:
            torch.set_rng_state(rngs[rank])  # after the reseed: the stream the run was at
        for step, (x, y, ids) in enumerate(batches):
            if epoch == start_epoch and step < start_step:
                continue  # trained before the restart
            loss = torch.nn.functional.mse_loss(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(
                f"samples: {rank} {epoch * len(loader) + step} {','.join(map(str, ids.tolist()))}",
                flush=True,
            )
            if rank == 0:
                print(
                    f"Epoch:[{epoch + 1}/{args.epochs}]({step}/{len(loader)}) "
                    f"loss:{loss.item():.6f}",
                    flush=True,
                )
            done = step + 1
            if done % args.save_every == 0 and done < len(loader):
                states: list[object] = [None] * world
                if ddp:
                    dist.all_gather_object(states, torch.get_rng_state())
                else:
                    states = [torch.get_rng_state()]
                if rank == 0:
                    state = {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "epoch": epoch,
                        "step": done,
                        "rng": states,
                    }
                    torch.save(state, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                if ddp:
                    dist.barrier()
            time.sleep(0.05)
        start_step = 0
    if rank == 0:
        torch.save({"model": model.state_dict()}, os.path.join(args.out, "final.pt"))
        print("training done", flush=True)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
