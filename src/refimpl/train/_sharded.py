"""``python -m refimpl.train --sharded``: FSDP2 and chapter 8's DCP checkpoints.

Every rank holds and writes only its shard of the weights and the optimizer state
(`refimpl.sharded.save_sharded`, committed when every rank's files are durable), and a start
at any world size loads and reshards it. What the DDP path keeps in rank 0's file besides the
weights travels here in ``state=``, in the same commit, the same on every rank: the step, the
sampler's global position and the LR scheduler (`refimpl.train._schedule`), which is all an
exact resume at another world size needs. ``--async-save`` hands the same arguments to an
`refimpl.sharded.AsyncSaver` instead (`refimpl.train._async`).

Dropout's RNG is not saved, so there is no `refimpl.sharded.PerRank` entry: a rank's stream is
re-seeded from (seed, rank, step) at every step, so a resumed step draws what the
uninterrupted run drew at the same world size (at another world size the ranks, and so the
streams, differ anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import LRScheduler

from refimpl.checkpoint import list_checkpoints, step_dir_name
from refimpl.data import ResumableSampler
from refimpl.sharded import ShardedCheckpointError, load_sharded, save_sharded
from refimpl.train._config import TrainConfig
from refimpl.train._flags import refuse, reset_lr, resume_problems, sampler_entry
from refimpl.train._restorable import scheduler_misfit
from refimpl.train._resume import refuse_fresh_start
from refimpl.train._schedule import check_restored, flat_schedule


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


def wrap_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The trainer's `shard_model`."""
    return shard_model(model, device)


def seed_step(seed: int, rank: int, step: int) -> None:
    """This rank's dropout stream for ``step``: a function of where we are, not of history."""
    torch.manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)


def trainer_state(
    sched: LRScheduler, sampler_state: Mapping[str, int], step: int
) -> dict[str, Any]:
    """The ``state=`` of a save: equal on every rank, so each entry is shared (saved once).
    ``sampler_state``: the trainer's sampler entry (`refimpl.train._flags.sampler_entry`)."""
    return {"step": step, "sampler": dict(sampler_state), "scheduler": sched}


def save(
    config: TrainConfig,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: LRScheduler,
    sampler_state: Mapping[str, int],
    step: int,
    log: Callable[[str], None],
) -> None:
    """Collective: every rank writes its shard; rank 0 commits the step when all are durable."""
    state = trainer_state(sched, sampler_entry(config, sampler_state), step)
    path = save_sharded(config.ckpt_dir, model, opt, step, keep_last=config.keep_last, state=state)
    if dist.get_rank() == 0:
        log(f"saved {path.name}")


def close() -> None:
    """Nothing to wait for: `save` returns once its step is committed."""


def load(
    config: TrainConfig,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: LRScheduler,
    sampler: ResumableSampler,
    device: torch.device,
    log: Callable[[str], None],
    on_skip: Callable[[Path, str], None],
) -> int:
    """Collective: load the newest good step at this world size, less ``--no-restore``;
    return it (0 without one; each step skipped goes to ``on_skip``). Rank 0 picks the step
    for everyone; DCP reshards. When committed steps exist and none loads, 0 too, the load's
    error passed to ``on_skip``: the caller (`refimpl.train._resume.refuse_fresh_start`) then
    stops, naming the reason or the flag."""
    Path(config.ckpt_dir).mkdir(parents=True, exist_ok=True)  # a new run's root: a fresh start
    state: dict[str, Any] = {"step": None, "sampler": None, "scheduler": sched}
    optimizer = None if "optimizer" in config.no_restore else opt
    try:
        step = load_sharded(config.ckpt_dir, model, optimizer, state=state, on_skip=on_skip)
    except ShardedCheckpointError as err:
        if refuse_fresh_start(config.ckpt_dir, True, []) is None:
            raise
        on_skip(err.path, str(err))  # the reason the caller's refusal names
        return 0
    if step is None:
        return 0
    why = _misfit(state, step, opt)
    if why is not None:  # it verified, but does not fit: fall back as past a damaged step
        found = _older(config, model, optimizer, opt, state, step, why, on_skip)
        if found is None:
            return 0  # the caller stops, with every step's reason
        step = found
    # The model is in memory, nothing is trained or written: refuse a flag that contradicts
    # the step before the first step (the sampler's own seed check would say it in its words).
    base_lrs = [float(lr) for lr in sched.base_lrs]
    refuse(
        resume_problems(config, step, base_lrs, state["sampler"]), dist.get_rank(), config.ckpt_dir
    )
    if config.reset_lr:
        reset_lr(config, sched, opt, step, log)
    check_restored(sched, opt, step, config.ckpt_dir, flat=flat_schedule(config))
    if "data" not in config.no_restore:
        sampler.load_state_dict(state["sampler"])
    return step


def _misfit(state: Mapping[str, Any], step: int, opt: torch.optim.Optimizer) -> str | None:
    """Why the trainer state just loaded with ``step`` cannot be used, naming the entry."""
    if state["step"] != step:
        return f"its 'step' entry says {state['step']!r}"
    sampler = state["sampler"]
    if not isinstance(sampler, Mapping) or not all(
        type(sampler.get(k)) is int for k in ("seed", "epoch", "position")
    ):
        return "its 'sampler' entry is not a sampler position (seed, epoch, position)"
    return scheduler_misfit(state["scheduler"].state_dict(), opt)


def _older(
    config: TrainConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    opt: torch.optim.Optimizer,
    state: dict[str, Any],
    step: int,
    why: str,
    on_skip: Callable[[Path, str], None],
) -> int | None:
    """Collective: report ``step`` as skipped, then load the newest older step that loads and
    fits, one step directory at a time (rank 0's listing); return it, or None."""
    root = Path(config.ckpt_dir)
    on_skip(root / step_dir_name(step), f"verified, but cannot be restored: {why}")
    listing: list[list[str] | None] = [None]
    if dist.get_rank() == 0:
        listing[0] = [str(d) for s, d in list_checkpoints(root) if s < step]
    dist.broadcast_object_list(listing, src=0)
    for step_dir in reversed(listing[0] or []):
        try:
            found = load_sharded(step_dir, model, optimizer, state=state)
        except ShardedCheckpointError as err:
            on_skip(Path(step_dir), err.reason)
            continue
        why_not = None if found is None else _misfit(state, found, opt)
        if found is not None and why_not is None:
            return found
        on_skip(Path(step_dir), f"verified, but cannot be restored: {why_not}")
    return None


def final_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded weights on CPU (rank 0 gets them; the others get {})."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    return {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
