"""``python -m refimpl.train`` without ``--sharded``: DDP and chapter 5-6's file checkpoints.

Rank 0 writes the whole training state (`refimpl.state.capture_state`: weights without the
``module.`` prefix, AdamW, the sampler position, every rank's RNG) as one verified
checkpoint; the other ranks wait for it with chapter 4's `main_process_first`. On a start,
every rank reads the newest checkpoint that verifies, and the ranks check that they found
the same one. `refimpl._train_sharded` has the same two functions for FSDP2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refimpl.checkpoint import load_latest, save_checkpoint
from refimpl.data import ResumableSampler
from refimpl.state import capture_rng, capture_state, restore_state, unwrap_state_dict
from refimpl.sync import main_process_first


def save(
    args: argparse.Namespace,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sampler: ResumableSampler,
    step: int,
    log: Callable[[str], None],
) -> None:
    """Every rank captures its RNG, rank 0 writes the checkpoint, the others wait for it."""
    world = dist.get_world_size()
    rngs: list[Any] = [None] * world
    dist.all_gather_object(rngs, capture_rng())  # each rank's dropout stream differs: keep all
    state = capture_state(model, opt, sampler_state=sampler.state_dict(), rng=rngs,
                          epoch=sampler.epoch, step=step, world_size=world)  # fmt: skip
    # The other ranks wait here (not in the next step's all-reduce, under the training
    # timeout) and raise at once if rank 0's save fails: chapter 4.
    with main_process_first(timeout_s=args.save_timeout if world > 1 else None) as is_main:
        if is_main:
            path = save_checkpoint(args.ckpt_dir, state, step, keep_last=args.keep_last)
            log(f"saved {path.name}")


def load(
    args: argparse.Namespace,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sampler: ResumableSampler,
    device: torch.device,
    log: Callable[[str], None],
    on_skip: Callable[[Path, str], None],
) -> int:
    """Restore the newest checkpoint on every rank, less ``--no-restore``; return its step
    (0 without one); each step skipped goes to ``on_skip(step_dir, reason)``."""
    found = load_latest(args.ckpt_dir, map_location=device,
                        on_skip=on_skip)  # fmt: skip
    # Every rank reads the directory itself; on nodes without a shared filesystem (or with one
    # that lags) they can see different steps, and would then silently train different models.
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, None if found is None else found[0])
    if len(set(seen)) > 1:
        raise RuntimeError(
            f"rank {dist.get_rank()}: ranks found different latest checkpoints in "
            f"{args.ckpt_dir} (by rank: {seen}). Put --ckpt-dir on a filesystem every node sees."
        )
    if found is None:
        return 0
    state = dict(found[1])
    if "rng" in args.no_restore:
        state["rng"] = None
    optimizer = None if "optimizer" in args.no_restore else opt
    info = restore_state(state, model, optimizer, rank=dist.get_rank(),
                         world_size=dist.get_world_size())  # fmt: skip
    if "data" not in args.no_restore:
        sampler.load_state_dict(info["sampler"])
    if info["world_size"] != dist.get_world_size():
        log(f"checkpoint is from {info['world_size']} ranks: RNG streams start afresh")
    return int(info["step"])


def final_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights to publish, without DDP's ``module.`` prefix (no collective)."""
    return unwrap_state_dict(model)
