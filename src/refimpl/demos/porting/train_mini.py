"""train_mini.py: a trainer in MiniMind's style, with the five traps of chapter 12's
second half.

Run it alone (one process; the traps are per process, DDP adds nothing to them)::

    python train_mini.py --out out [--trap reseed|loader|fp16|scaler|accum]

What it does, as MiniMind's pretraining script does it: ``setup_seed(42 + epoch)`` at
the top of every epoch; a ``DataLoader`` with two worker processes, shuffling, over a
dataset whose ``__getitem__`` draws a random augmentation; fp16 autocast with a
``GradScaler``; gradient accumulation; a checkpoint ``out/ckpt.pth`` every
``--save-every`` batches (``torch.save`` then ``os.replace``); a start that finds it
resumes there and skips the batches the epoch already trained. ``final.pt`` holds the
final weights (the file the kill test compares).

Without ``--trap`` its resume is exact. Each ``--trap`` puts back one thing such
scripts get wrong, and only that:

- ``reseed``: the saved RNG state is restored right after loading, and the epoch's
  ``setup_seed(42 + epoch)`` then overwrites it;
- ``loader``: restored after the reseed but before ``iter(loader)``, which draws the
  workers' base seed and the shuffle's seed from the global RNG (the exact resume
  restores after it);
- ``fp16``: the weights are saved as ``model.half()``'s (MiniMind's ``v.half()``) and
  loaded back into the fp32 model;
- ``scaler``: the ``GradScaler``'s state is not saved (a resume restarts at scale
  65536);
- ``accum``: saves land on ``step % save_every == 0`` (MiniMind's condition), in the
  middle of an accumulation window, whose gradients no checkpoint holds (the exact
  resume saves only right after an optimizer step).
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

TRAPS = ("reseed", "loader", "fp16", "scaler", "accum")


def setup_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class PretrainDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """64 samples of 8 features; each read adds random noise (an augmentation),
    drawn in the loader's worker process from the RNG the loader seeded it with."""

    def __init__(self, n: int = 64) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(5))
        self.y = self.x.sum(1, keepdim=True).cos()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accumulation-steps", type=int, default=2)
    p.add_argument("--save-every", type=int, default=8)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--trap", choices=TRAPS)
    args = p.parse_args()
    trap, accum = args.trap, args.accumulation_steps
    setup_seed(42)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.GELU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(32, 1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    ckpt_path = os.path.join(args.out, "ckpt.pth")
    start_epoch, start_step, rng = 0, 0, {}
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ckpt["model"])  # copies into the fp32 parameters
        optimizer.load_state_dict(ckpt["optimizer"])
        if "scaler" in ckpt:
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch, start_step, rng = ckpt["epoch"], ckpt["step"], ckpt["rng"]
        print(f"resuming from epoch {start_epoch} step {start_step}")
        if trap == "reseed":
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["random"])
            np.random.set_state(rng["numpy"])
    os.makedirs(args.out, exist_ok=True)
    loader = DataLoader(PretrainDataset(), batch_size=4, shuffle=True, num_workers=2)
    for epoch in range(start_epoch, args.epochs):
        setup_seed(42 + epoch)
        resuming = bool(rng) and epoch == start_epoch
        if resuming and trap == "loader":
            # before iter(loader), which draws from it
            torch.set_rng_state(rng["torch"])
        batches = iter(loader)  # draws the workers' base seed and the shuffle's seed
        if resuming and trap not in ("reseed", "loader"):
            torch.set_rng_state(rng["torch"])  # the stream where the saved run was
            random.setstate(rng["random"])
            np.random.set_state(rng["numpy"])
        for step, (x, y) in enumerate(batches):
            if epoch == start_epoch and step < start_step:
                continue  # trained before the restart (its augmentation drawn again)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) / accum
            scaler.scale(loss).backward()
            if (step + 1) % accum == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            print(
                f"Epoch:[{epoch + 1}/{args.epochs}]({step}/{len(loader)}) "
                f"loss:{loss.item() * accum:.6f} scale:{scaler.get_scale():g}"
            )
            if (step if trap == "accum" else step + 1) % args.save_every == 0:
                weights = model.state_dict()
                if trap == "fp16":
                    weights = {k: v.half() for k, v in weights.items()}
                state = {
                    "model": weights,
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                    "step": step + 1,
                    "rng": {
                        "torch": torch.get_rng_state(),
                        "random": random.getstate(),
                        "numpy": np.random.get_state(),
                    },
                }
                if trap != "scaler":
                    state["scaler"] = scaler.state_dict()
                torch.save(state, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            time.sleep(args.step_sleep)
        start_step = 0
    torch.save({"model": model.state_dict()}, os.path.join(args.out, "final.pt"))
    print("training done")


if __name__ == "__main__":
    main()
