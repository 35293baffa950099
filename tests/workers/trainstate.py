"""Workers for tests/test_trainstate.py (spawned ranks import them by name)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
import torch.distributed as dist

from refimpl.checkpoint import CheckpointError, save_checkpoint
from refimpl.data import RandomOffsets, ResumableSampler
from refimpl.train import _files
from refimpl.train._schedule import make_scheduler
from refimpl.trainstate import (
    CheckpointMismatch,
    capture_every_rank,
    check_same_checkpoint,
    resume_every_rank,
)


def tiny_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same small model and optimizer on every rank."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def capture_then_draw(ckpt_dir: str, step: int) -> dict[str, Any]:
    """Capture on every rank (each with its own stream), rank 0 saves; then draw 4 numbers."""
    rank = dist.get_rank()
    model, opt = tiny_model()
    torch.manual_seed(100 + rank)
    torch.rand(5)  # somewhere inside the stream, not at its seed
    state = capture_every_rank(
        model,
        opt,
        sampler_state={"seed": 0, "epoch": 1, "position": 8},
        epoch=1,
        step=step,
        extra={"best_val_loss": 1.5, "config": {"lr": 0.1}},
    )
    after = torch.rand(4).tolist()  # what this rank draws right after the capture
    if rank == 0:
        assert state is not None
        save_checkpoint(ckpt_dir, state, step)
    dist.barrier()
    summary = None
    if state is not None:
        summary = {
            "keys": sorted(state),
            "world_size": state["world_size"],
            "rngs": len(state["rng"]),
        }
    return {"after": after, "state": summary}


def resume_then_draw(ckpt_dir: str) -> dict[str, Any]:
    """A fresh start: seed differently, resume, and draw 4 numbers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = tiny_model()
    torch.nn.init.zeros_(model.weight)  # so a restored weight is visible
    torch.manual_seed(999 + rank)
    fresh = torch.get_rng_state()
    sampler = ResumableSampler(16, batch_size=2, rank=rank, world_size=world, seed=0)
    resumed = resume_every_rank(ckpt_dir, model, opt, sampler=sampler)
    assert resumed is not None
    return {
        "step": resumed.step,
        "extra": resumed.extra,
        "rng_restored": resumed.rng_restored,
        "kept_own_stream": torch.equal(torch.get_rng_state(), fresh),
        "next": torch.rand(4).tolist(),
        "sampler": sampler.state_dict(),
        "digest": resumed.digest,
        "weight_restored": bool(model.weight.abs().sum() > 0),
    }


def check_views(views: list[tuple[int | None, str | None]]) -> Any:
    """Each rank reports ``views[rank]``: None when they agree, else what the error saw."""
    step, digest = views[dist.get_rank()]
    try:
        check_same_checkpoint(step, digest, ckpt_dir="ckpt")
    except CheckpointMismatch as exc:
        return {"seen": exc.seen, "message": str(exc)}
    return None


def resume_from_own_dir(dirs: list[str]) -> Any:
    """Each rank resumes from ``dirs[rank]`` (nodes that do not share a filesystem)."""
    model, opt = tiny_model()
    try:
        resumed = resume_every_rank(dirs[dist.get_rank()], model, opt)
    except CheckpointMismatch as exc:
        return {"seen": exc.seen, "message": str(exc)}
    return None if resumed is None else resumed.step


def train_files_load_from_own_dir(dirs: list[str]) -> Any:
    """`refimpl.train`'s loader, each rank pointed at ``dirs[rank]``: what it raises."""
    model, opt = tiny_model()
    sampler = ResumableSampler(
        16, batch_size=2, rank=dist.get_rank(), world_size=dist.get_world_size()
    )
    args = argparse.Namespace(
        ckpt_dir=dirs[dist.get_rank()],
        no_restore=[],
        lr_schedule="constant",
        warmup_steps=0,
        steps=8,
    )
    sched = make_scheduler(opt, "constant", 0, 8)
    try:
        step = _files.load(
            args, model, opt, sched, sampler, torch.device("cpu"), print, lambda d, why: None
        )
    except CheckpointMismatch as exc:
        return {"seen": exc.seen, "message": str(exc)}
    return step


def resume_or_error(ckpt_dir: str) -> str:
    """What `resume_every_rank` does on this rank: the step, None, or the error's message."""
    model, opt = tiny_model()
    try:
        resumed = resume_every_rank(ckpt_dir, model, opt)
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"
    return f"step {resumed.step}" if resumed is not None else "None"


def accumulate(
    ckpt_dir: str,
    stop_at: tuple[int, int] | None = None,
    resume: bool = False,
    save_micro: bool = True,
    steps: int = 3,
    accum: int = 4,
) -> dict[str, Any] | None:
    """fp16-style training with a GradScaler and gradient accumulation (DDP ``no_sync`` on
    all but the last micro-batch), batches from `RandomOffsets`. ``stop_at=(s, m)``: capture
    every rank before micro-batch m of step s, rank 0 saves, return None. ``resume``: start
    from the newest checkpoint. The loss of step 0's last micro-batch is made infinite, so the
    scaler skips that step and halves its scale: a resume that loses it shows 65536 again.
    ``save_micro=False`` captures without the micro-step (and the gradients): the trap."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1)
    )
    net: torch.nn.Module = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    offsets = RandomOffsets(64, 4, seed=0, rank=rank, world_size=world)
    torch.manual_seed(10 + rank)  # this rank's dropout stream
    step, micro = 0, 0
    if resume:
        resumed = resume_every_rank(ckpt_dir, net, opt, scaler=scaler)
        assert resumed is not None
        step, micro = resumed.step, resumed.micro_step
        offsets.load_state_dict(resumed.extra["offsets"])
    while step < steps:
        while micro < accum:
            if (step, micro) == stop_at:
                state = capture_every_rank(
                    net,
                    opt,
                    scaler=scaler,
                    step=step,
                    micro_step=micro if save_micro else 0,
                    extra={"offsets": offsets.state_dict()},
                )
                if state is not None:
                    save_checkpoint(ckpt_dir, state, step * accum + micro)
                if world > 1:
                    dist.barrier()
                return None
            sync = world == 1 or micro == accum - 1
            with contextlib.nullcontext() if sync else net.no_sync():  # type: ignore[operator]
                idx = offsets.next()
                loss = torch.nn.functional.mse_loss(net(x[idx]), y[idx]) / accum
                if step == 0 and micro == accum - 1:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            micro += 1
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        step, micro = step + 1, 0
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "scale": scaler.get_scale(),
    }
