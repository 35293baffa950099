"""train_gpt.py: a nanoGPT-style trainer, as such scripts are written (chapter 12).

Run it alone, or under torchrun (DDP on every rank, gloo on CPU)::

    torchrun --standalone --nproc-per-node=2 train_gpt.py --out_dir=out --data_dir=data

Rank 0 evaluates every ``eval_interval`` iterations and ``torch.save``s
``out_dir/ckpt.pt`` in place; a start that finds ``ckpt.pt`` resumes from it
(``init_from = "resume"``). Batches are random offsets drawn with ``torch.randint``
from the RNG seeded ``1337 + rank``.
"""

import json
import math
import os
import sys
import time
import zlib
from ast import literal_eval
from typing import Any

import numpy as np
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.demos.porting.model import GPT, GPTConfig

# -----------------------------------------------------------------------------
# default config values: a character-level model of a few sonnets, on CPU
out_dir = "out"
data_dir = "data"
eval_interval = 4
eval_iters = 2
log_interval = 1
always_save_checkpoint = True
init_from = "resume"  # resume from out_dir/ckpt.pt if there is one, else from scratch
batch_size = 4
block_size = 16
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.2
bias = False
learning_rate = 1e-3
max_iters = 12
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0
decay_lr = True
warmup_iters = 2
lr_decay_iters = 12
min_lr = 1e-4
backend = "gloo"
step_sleep = 0.0  # for the kill test: time for a kill to land where it is aimed
draws_log = ""  # for chapter 12: log a digest of each rank's batch, each iteration
# -----------------------------------------------------------------------------
config_keys = [
    k
    for k, v in globals().items()
    if not k.startswith("_") and isinstance(v, (int, float, bool, str))
]
for arg in sys.argv[1:]:  # nanoGPT's configurator: --key=value overrides a default
    key, val = arg[2:].split("=", 1)
    assert key in globals(), f"unknown config key {key}"
    try:
        globals()[key] = literal_eval(val)
    except (SyntaxError, ValueError):
        globals()[key] = val
config = {k: globals()[k] for k in config_keys}
# -----------------------------------------------------------------------------

ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
    seed_offset = ddp_rank  # each process gets a different seed
else:
    ddp_rank, ddp_world_size, master_process, seed_offset = 0, 1, True, 0
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    # recreate np.memmap every batch to avoid a memory leak, as nanoGPT does
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack(
        [torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix]
    )
    y = torch.stack(
        [
            torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64))
            for i in ix
        ]
    )
    return x, y


iter_num = 0
best_val_loss = 1e9
with open(os.path.join(data_dir, "meta.json")) as f:
    meta_vocab_size = json.load(f)["vocab_size"]
model_args: dict[str, Any] = dict(
    n_layer=n_layer,
    n_head=n_head,
    n_embd=n_embd,
    block_size=block_size,
    bias=bias,
    vocab_size=meta_vocab_size,
    dropout=dropout,
)
ckpt_path = os.path.join(out_dir, "ckpt.pt")
checkpoint: Any = None
if init_from == "resume" and os.path.exists(ckpt_path):
    if master_process:  # one rank prints: lines of two ranks at once can interleave
        print(f"Resuming training from {out_dir}")
    checkpoint = torch.load(ckpt_path, map_location="cpu")
    for k in ["n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"]:
        model_args[k] = checkpoint["model_args"][k]
    model = GPT(GPTConfig(**model_args))
    model.load_state_dict(checkpoint["model"])
    iter_num = checkpoint["iter_num"]
    best_val_loss = checkpoint["best_val_loss"]
else:
    if master_process:
        print("Initializing a new model from scratch")
    model = GPT(GPTConfig(**model_args))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None  # free up memory
train_model: torch.nn.Module = DDP(model) if ddp else model


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            _, loss = model(X, Y)
            assert loss is not None
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it: int) -> float:  # linear warmup, then cosine decay to min_lr
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


X, Y = get_batch("train")  # fetch the very first batch
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    # evaluate the loss on train/val sets and write checkpoints
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        train_loss, val_loss = losses["train"], losses["val"]
        print(f"step {iter_num}: train loss {train_loss:.4f}, val loss {val_loss:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "model_args": model_args,
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                    "config": config,
                }
                print(f"saving checkpoint to {out_dir}")
                torch.save(checkpoint, ckpt_path)
    if draws_log:  # for chapter 12: what this rank trains at this iteration
        with open(f"{draws_log}.rank{ddp_rank}", "a") as log:
            log.write(f"{iter_num} {zlib.crc32(X.numpy().tobytes()):08x}\n")
    _, loss = train_model(X, Y)
    assert loss is not None
    # immediately fetch the next batch, as nanoGPT's prefetch does
    X, Y = get_batch("train")
    loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % log_interval == 0 and master_process:
        print(f"iter {iter_num}: loss {loss.item():.4f}")
    iter_num += 1
    time.sleep(step_sleep)
    if iter_num > max_iters:
        break

if master_process:  # for the kill test: the final weights
    torch.save(
        {"model": model.state_dict(), "iter_num": iter_num},
        os.path.join(out_dir, "final.pt"),
    )
    print("done")
if ddp:
    destroy_process_group()
