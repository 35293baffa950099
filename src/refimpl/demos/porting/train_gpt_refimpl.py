"""train_gpt_refimpl.py: train_gpt.py ported to refimpl (chapter 12's "after").

Run it alone, or under torchrun (DDP on every rank, gloo on CPU)::

    torchrun --standalone --nproc-per-node=2 train_gpt_refimpl.py \
        --out_dir=out --data_dir=data

Every ``eval_interval`` iterations every rank captures its state (RNG included) before
rank 0 evaluates, and rank 0 saves it as a verified ``out_dir/ckpt/step_N``; every
start resumes from the newest one that verifies. Training batches are random offsets
drawn with replacement, as before, from a `RandomOffsets` whose state is one counter.
"""

import json
import math
import os
import sys
import time
import zlib
from ast import literal_eval
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch
from torch.distributed import destroy_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.checkpoint import load_latest, save_checkpoint
from refimpl.data import RandomOffsets
from refimpl.demos.porting.model import GPT, GPTConfig
from refimpl.launch import init_from_env
from refimpl.preemption import StopOnSigterm
from refimpl.trainstate import capture_every_rank, resume_every_rank

# -----------------------------------------------------------------------------
# default config values: a character-level model of a few sonnets, on CPU
out_dir = "out"
data_dir = "data"
eval_interval = 4
eval_iters = 2
log_interval = 1
always_save_checkpoint = True
init_from = "resume"  # resume from out_dir/ckpt if it holds a step, else from scratch
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
    init_from_env(timeout_s=60)  # safe on torchrun's restarts (chapter 10)
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
    seed_offset = ddp_rank  # each process gets a different seed
else:
    ddp_rank, ddp_world_size, master_process, seed_offset = 0, 1, True, 0
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)


def get_batch(split: str, ix: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    # recreate np.memmap every batch to avoid a memory leak, as nanoGPT does
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    if ix is None:  # evaluation: random offsets from the RNG; training passes its own
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
ckpt_dir = os.path.join(out_dir, "ckpt")
found = load_latest(ckpt_dir, keys=["model_args"]) if init_from == "resume" else None
if found is not None:  # the model's shape from the newest step (nothing else is read)
    for k in ["n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"]:
        model_args[k] = found[1]["model_args"][k]
model = GPT(GPTConfig(**model_args))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
train = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
n_offsets = len(train) - block_size  # nanoGPT's sampling, resumable: one counter
offsets = RandomOffsets(
    n_offsets, batch_size, seed=1337, rank=ddp_rank, world_size=ddp_world_size
)
resumed = None
if init_from == "resume":
    # every rank: the newest good step, the same everywhere, each its own RNG
    resumed = resume_every_rank(ckpt_dir, model, optimizer)
if resumed is not None:
    if master_process:  # one rank prints: lines of two ranks at once can interleave
        print(f"Resuming training from {ckpt_dir} at iter {resumed.step}")
    offsets.load_state_dict(resumed.extra["offsets"])
    assert resumed.extra["model_args"] == model_args, "a checkpoint of another model"
    iter_num, best_val_loss = resumed.step, resumed.extra["best_val_loss"]
elif master_process:
    print("Initializing a new model from scratch")
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


X, Y = get_batch("train", offsets.next())  # fetch the very first batch
preempt = ExitStack().enter_context(StopOnSigterm())  # SIGTERM: save, exit 0
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    stop = preempt.should_stop() and iter_num > 0  # a signal to one rank stops all
    if (iter_num % eval_interval == 0 and iter_num > 0) or stop:
        # every rank, before rank 0's eval draws from its RNG: a resume re-enters here
        keys = dict(model_args=model_args, config=config, best_val_loss=best_val_loss)
        keys["offsets"] = offsets.state_dict(prefetched=1)  # the batch in hand: again
        state = capture_every_rank(model, optimizer, step=iter_num, extra=keys)
    if stop:
        if master_process:
            assert state is not None
            print(f"SIGTERM: saving iter {iter_num} to {out_dir}, then exiting")
            save_checkpoint(ckpt_dir, state, iter_num)
        break
    # evaluate the loss on train/val sets and write checkpoints
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        train_loss, val_loss = losses["train"], losses["val"]
        print(f"step {iter_num}: train loss {train_loss:.4f}, val loss {val_loss:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                assert state is not None  # rank 0 holds what every rank captured
                print(f"saving checkpoint to {out_dir}")
                save_checkpoint(ckpt_dir, state, iter_num)
    if draws_log:  # for chapter 12: what this rank trains at this iteration
        with open(f"{draws_log}.rank{ddp_rank}", "a") as log:
            log.write(f"{iter_num} {zlib.crc32(X.numpy().tobytes()):08x}\n")
    _, loss = train_model(X, Y)
    assert loss is not None
    # immediately fetch the next batch, as nanoGPT's prefetch does
    X, Y = get_batch("train", offsets.next())
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

if master_process and not stop:  # for the kill test: the final weights
    torch.save(
        {"model": model.state_dict(), "iter_num": iter_num},
        os.path.join(out_dir, "final.pt"),
    )
    print("done")
if ddp:
    destroy_process_group()
