"""``python -m refimpl.train`` without ``--sharded``: DDP and chapter 5-6's file checkpoints.

Rank 0 writes the whole training state (`refimpl.trainstate.capture_every_rank`: weights
without the ``module.`` prefix, AdamW, the LR scheduler, the sampler position, every rank's
RNG) as one verified
checkpoint; the other ranks wait for it with chapter 4's `main_process_first`. On a start,
every rank reads the newest checkpoint that verifies, and the ranks check that they found
the same one (`refimpl.trainstate.check_same_checkpoint`). `refimpl._train_sharded` has the
same two functions for FSDP2. With ``--async-save``, `AsyncFileSaves` writes each
checkpoint on rank 0 in the background instead (`refimpl.checkpoint.AsyncCheckpointer`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from refimpl._train_schedule import check_restored, flat_schedule
from refimpl.checkpoint import AsyncCheckpointer, load_latest, save_checkpoint
from refimpl.data import ResumableSampler
from refimpl.state import restore_state, unwrap_state_dict
from refimpl.sync import main_process_first
from refimpl.trainstate import capture_every_rank, check_same_checkpoint, manifest_digest


def save(
    args: argparse.Namespace,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: LRScheduler,
    sampler_state: Mapping[str, int],
    step: int,
    log: Callable[[str], None],
) -> None:
    """Every rank captures its RNG, rank 0 writes the checkpoint, the others wait for it."""
    world = dist.get_world_size()
    # Every rank's RNG goes to rank 0 (each rank's dropout stream differs: keep all).
    state = capture_every_rank(model, opt, scheduler=sched, sampler_state=sampler_state,
                               epoch=int(sampler_state["epoch"]), step=step)  # fmt: skip
    # The other ranks wait here (not in the next step's all-reduce, under the training
    # timeout) and raise at once if rank 0's save fails: chapter 4.
    with main_process_first(timeout_s=args.save_timeout if world > 1 else None) as is_main:
        if is_main:
            assert state is not None  # rank 0 gets the state
            path = save_checkpoint(args.ckpt_dir, state, step, keep_last=args.keep_last)
            log(f"saved {path.name}")


class AsyncFileSaves:
    """`save`'s signature, in the background: rank 0 stages the state and returns; its
    `AsyncCheckpointer` writes and commits while the next steps train. The other ranks
    only take part in gathering the RNG states and never wait for rank 0's write: no barrier,
    since no rank is held up long enough to time out in its next collective. Rank 0 raises a
    failed save at its next save or at `close`, and exits non-zero; a restart resumes from
    the last committed step. ``close`` waits for the last save (before the final weights,
    and before an exit 0 after SIGTERM: the trainer's own SIGTERM flag does the stopping)."""

    def __init__(self, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        self._log = log
        self._saver = None
        if dist.get_rank() == 0:
            self._saver = AsyncCheckpointer(
                args.ckpt_dir, keep_last=args.keep_last, wait_on_sigterm=False
            )

    def _wait(self) -> None:
        path = None if self._saver is None else self._saver.wait()
        if path is not None:
            self._log(f"saved {path.name}")  # the commit, logged once it is known

    def save(
        self,
        args: argparse.Namespace,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        sched: LRScheduler,
        sampler_state: Mapping[str, int],
        step: int,
        log: Callable[[str], None],
    ) -> None:
        """Gather the state on rank 0 (a collective), wait for the save in flight, stage this
        one and return."""
        epoch = int(sampler_state["epoch"])
        state = capture_every_rank(
            model, opt, scheduler=sched, sampler_state=sampler_state, epoch=epoch, step=step
        )
        if self._saver is None:
            return
        assert state is not None  # rank 0 gets the state
        self._wait()
        self._saver.save(state, step)
        log(f"saving step {step} in the background")

    def close(self) -> None:
        """Wait for the last save to commit (or raise its error), then free the staging."""
        if self._saver is None:
            return
        try:
            self._wait()
        finally:
            self._saver.close()


def load(
    args: argparse.Namespace,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: LRScheduler,
    sampler: ResumableSampler,
    device: torch.device,
    log: Callable[[str], None],
    on_skip: Callable[[Path, str], None],
) -> int:
    """Restore the newest checkpoint on every rank, less ``--no-restore``; return its step
    (0 without one); each step skipped goes to ``on_skip(step_dir, reason)``."""
    digest: dict[str, str] = {}
    found = load_latest(args.ckpt_dir, map_location=device, on_skip=on_skip,
                        on_load=lambda _, m: digest.update(d=manifest_digest(m)))  # fmt: skip
    # Every rank reads the directory itself; on nodes without a shared filesystem (or with one
    # that lags) they can see different steps, and would then silently train different models.
    check_same_checkpoint(None if found is None else found[0], digest.get("d"),
                          ckpt_dir=args.ckpt_dir)  # fmt: skip
    if found is None:
        return 0
    state: dict[str, Any] = dict(found[1])
    if "rng" in args.no_restore:
        state["rng"] = None
    optimizer = None if "optimizer" in args.no_restore else opt
    info = restore_state(state, model, optimizer, scheduler=sched, rank=dist.get_rank(),
                         world_size=dist.get_world_size())  # fmt: skip
    check_restored(sched, opt, int(info["step"]), args.ckpt_dir, flat=flat_schedule(args))
    if "data" not in args.no_restore:
        sampler.load_state_dict(info["sampler"])
    if info["world_size"] != dist.get_world_size():
        log(f"checkpoint is from {info['world_size']} ranks: RNG streams start afresh")
    return int(info["step"])


def final_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights to publish, without DDP's ``module.`` prefix (no collective)."""
    return unwrap_state_dict(model)
