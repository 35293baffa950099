"""A tiny trainer written the way nanoGPT's train.py is (self-written, no code copied), for the
kill-test tests: it calls ``init_process_group`` itself when torchrun set ``RANK``, echoes its
config, resumes by itself from ``OUT/ckpt.pt`` (``init_from = 'resume'``), draws each batch
from the global RNG and saves the checkpoint from rank 0 only.

    torchrun --standalone --nproc-per-node=2 --max-restarts=2 \\
        tests/workers/chaos_nanogpt_style.py \\
        --out OUT [--dropout 0.0] [--batches sequential] [--ckpt-dtype float16] [--rng-save]

Flags pick the variants the tests need: ``--ckpt-dtype float16`` keeps the checkpoint's weights
in fp16 (a resume then continues from rounded weights), ``--rng-save`` saves and restores
every rank's RNG (without it a resume draws other batches), ``--dropout 0.0 --batches
sequential`` leaves no randomness at all. ``--late-rank0 S``: after a restart, rank 0 builds
its process group S seconds after rank 1 (the restart then meets the killed attempt's keys
on torchrun's shared store more often: 3 restarts of 4 in a small sample here).
Prints
``samples: RANK STEP i,j,...`` for each batch it trains (the line format `refimpl.chaos`
counts samples by).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--save-every", type=int, default=4)
p.add_argument("--dropout", type=float, default=0.1)
p.add_argument("--batches", choices=["random", "sequential"], default="random")
p.add_argument("--ckpt-dtype", choices=["float32", "float16"], default="float32")
p.add_argument("--rng-save", action="store_true")
p.add_argument("--step-sleep", type=float, default=0.05)
p.add_argument("--late-rank0", type=float, default=0.0)
args = p.parse_args()
ckpt_path = os.path.join(args.out, "ckpt.pt")
init_from = "resume" if os.path.exists(ckpt_path) else "scratch"
print(f"Overriding: init_from = {init_from}, dropout = {args.dropout}", flush=True)

ddp = int(os.environ.get("RANK", -1)) != -1
restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
if ddp and restarted and int(os.environ["RANK"]) == 0:
    time.sleep(args.late_rank0)
if ddp:  # the trainer's own process group, as nanoGPT does it
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
else:
    rank, world = 0, 1
master = rank == 0
torch.manual_seed(1337)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(args.dropout), torch.nn.Linear(16, 1)
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.randn(48, 8, generator=torch.Generator().manual_seed(7))
target = data.sum(1, keepdim=True).sin()
torch.manual_seed(1337 + rank)  # each rank's own stream: batches and dropout
iter_num = 0
if init_from == "resume":
    print(f"Resuming training from {args.out}", flush=True)
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    model.load_state_dict({k: v.float() for k, v in ckpt["model"].items()})
    opt.load_state_dict(ckpt["optimizer"])
    iter_num = ckpt["iter_num"]
    if args.rng_save:
        torch.set_rng_state(ckpt["rng"][rank])
net = DDP(model) if ddp else model


def get_batch(step: int) -> torch.Tensor:
    if args.batches == "random":
        return torch.randint(len(data), (4,))
    return torch.arange(4) + (4 * (step * world + rank)) % len(data)


while iter_num < args.steps:
    idx = get_batch(iter_num)
    loss = torch.nn.functional.mse_loss(net(data[idx]), target[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"samples: {rank} {iter_num} {','.join(map(str, idx.tolist()))}", flush=True)
    iter_num += 1
    if master:
        print(f"iter {iter_num}: loss {loss.item():.4f}", flush=True)
    if iter_num % args.save_every == 0 and iter_num < args.steps:
        rngs: list[object] = [None] * world
        if ddp:
            dist.all_gather_object(rngs, torch.get_rng_state())
        else:
            rngs = [torch.get_rng_state()]
        if master:
            dtype = getattr(torch, args.ckpt_dtype)
            ckpt = {
                "model": {k: v.to(dtype) for k, v in model.state_dict().items()},
                "optimizer": opt.state_dict(),
                "iter_num": iter_num,
                "rng": rngs,
            }
            print(f"saving checkpoint to {args.out}", flush=True)
            torch.save(ckpt, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        if ddp:
            dist.barrier()
    time.sleep(args.step_sleep)
if master:
    torch.save(
        {"model": model.state_dict(), "iter_num": iter_num, "out_dir": args.out},
        os.path.join(args.out, "final.pt"),
    )
    print(f"done: {iter_num} iters", flush=True)
if ddp:
    dist.destroy_process_group()
sys.exit(0)
