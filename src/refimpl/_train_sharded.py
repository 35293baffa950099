"""``python -m refimpl.train --sharded``: FSDP2 and chapter 8's DCP checkpoints.

Every rank holds and writes only its shard of the weights and the optimizer state
(`refimpl.sharded.save_sharded`, committed when every rank's files are durable), and a start
at any world size loads and reshards it. What the DDP path keeps in rank 0's file besides the
weights travels here as DCP's ``extra`` tensors, the same on every rank: the step and the
sampler's global position, which is all an exact resume at another world size needs.

Dropout's RNG is not saved: a rank's stream is re-seeded from (seed, rank, step) at every
step, so a resumed step draws what the uninterrupted run drew at the same world size (at
another world size the ranks, and so the streams, differ anyway).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from refimpl.data import ResumableSampler
from refimpl.sharded import load_sharded, save_sharded


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2 on each linear layer and at the root, over a 1-D mesh of every rank; in place
    (the module becomes an FSDPModule) and returned."""
    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def seed_step(seed: int, rank: int, step: int) -> None:
    """This rank's dropout stream for ``step``: a function of where we are, not of history."""
    torch.manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)


def _extra(
    sampler_state: Mapping[str, int] | None = None, step: int = 0
) -> dict[str, torch.Tensor]:
    s: Mapping[str, Any] = sampler_state if sampler_state is not None else {}
    values = [step, s.get("seed", 0), s.get("epoch", 0), s.get("position", 0)]
    return {"trainer": torch.tensor(values, dtype=torch.int64)}


def save(
    args: argparse.Namespace,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sampler_state: Mapping[str, int],
    step: int,
    log: Callable[[str], None],
) -> None:
    """Collective: every rank writes its shard; rank 0 commits the step when all are durable."""
    path = save_sharded(args.ckpt_dir, model, opt, step, keep_last=args.keep_last,
                        extra=_extra(sampler_state, step))  # fmt: skip
    if dist.get_rank() == 0:
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
    """Collective: load the newest good step at this world size, less ``--no-restore``;
    return it (0 without one; each step skipped goes to ``on_skip``). Rank 0 picks the step
    for everyone; DCP reshards."""
    extra = _extra()
    optimizer = None if "optimizer" in args.no_restore else opt
    step = load_sharded(args.ckpt_dir, model, optimizer, extra=extra,
                        on_skip=on_skip)  # fmt: skip
    if step is None:
        return 0
    saved_step, seed, epoch, position = (int(v) for v in extra["trainer"])
    if saved_step != step:
        raise RuntimeError(f"{args.ckpt_dir}: step_{step} holds trainer state of step {saved_step}")
    if "data" not in args.no_restore:
        sampler.load_state_dict({"seed": seed, "epoch": epoch, "position": position})
    return step


def final_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded weights on CPU (rank 0 gets them; the others get {})."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    return {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
