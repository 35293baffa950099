"""``python -m refimpl.train`` without ``--sharded``: DDP and chapter 5-6's file checkpoints.

Rank 0 writes the whole training state (`refimpl.trainstate.capture_every_rank`: weights
without the ``module.`` prefix, AdamW, the LR scheduler, the sampler position, every rank's
RNG) as one verified
checkpoint; the other ranks wait for it with chapter 4's `main_process_first`. On a start,
every rank reads the newest checkpoint that verifies, and the ranks check that they found
the same one (`refimpl.trainstate.check_same_checkpoint`). `refimpl.train._sharded` has the
same two functions for FSDP2. With ``--async-save``, `AsyncFileSaves` writes each
checkpoint on rank 0 in the background instead (`refimpl.checkpoint.AsyncCheckpointer`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LRScheduler

from refimpl.checkpoint import AsyncCheckpointer, load_latest, save_checkpoint, step_dir_name
from refimpl.data import ResumableSampler
from refimpl.state import restore_state, unwrap_state_dict
from refimpl.sync import main_process_first
from refimpl.train._config import TrainConfig
from refimpl.train._flags import refuse, reset_lr, resume_problems, sampler_entry
from refimpl.train._restorable import misfit
from refimpl.train._schedule import check_restored, flat_schedule
from refimpl.trainstate import capture_every_rank, check_same_checkpoint, manifest_digest


def wrap_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP over every rank, the model moved to ``device``."""
    return DDP(model.to(device), device_ids=[device] if device.type == "cuda" else None)


def seed_step(seed: int, rank: int, step: int) -> None:
    """Nothing: every rank's RNG is saved and restored with the checkpoint."""


def save(
    config: TrainConfig,
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
    state = capture_every_rank(
        model,
        opt,
        scheduler=sched,
        sampler_state=sampler_entry(config, sampler_state),
        epoch=int(sampler_state["epoch"]),
        step=step,
    )
    # The other ranks wait here (not in the next step's all-reduce, under the training
    # timeout) and raise at once if rank 0's save fails: chapter 4.
    with main_process_first(timeout_s=config.save_timeout if world > 1 else None) as is_main:
        if is_main:
            assert state is not None  # rank 0 gets the state
            path = save_checkpoint(config.ckpt_dir, state, step, keep_last=config.keep_last)
            log(f"saved {path.name}")


def close() -> None:
    """Nothing to wait for: `save` returns once its step is committed."""


class AsyncFileSaves:
    """`save`'s signature, in the background: rank 0 stages the state and returns; its
    `AsyncCheckpointer` writes and commits while the next steps train. The other ranks
    only take part in gathering the RNG states and never wait for rank 0's write: no barrier,
    since no rank is held up long enough to time out in its next collective. Rank 0 raises a
    failed save at its next save or at `close`, and exits non-zero; a restart resumes from
    the last committed step. ``close`` waits for the last save (before the final weights,
    and before an exit 0 after SIGTERM: the trainer's own SIGTERM flag does the stopping)."""

    def __init__(self, config: TrainConfig, log: Callable[[str], None]) -> None:
        self._log = log
        self._saver = None
        if dist.get_rank() == 0:
            self._saver = AsyncCheckpointer(
                config.ckpt_dir, keep_last=config.keep_last, wait_on_sigterm=False
            )

    def _wait(self) -> None:
        path = None if self._saver is None else self._saver.wait()
        if path is not None:
            self._log(f"saved {path.name}")  # the commit, logged once it is known

    def save(
        self,
        config: TrainConfig,
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
    config: TrainConfig,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: LRScheduler,
    sampler: ResumableSampler,
    device: torch.device,
    log: Callable[[str], None],
    on_skip: Callable[[Path, str], None],
) -> int:
    """Restore the newest checkpoint on every rank, less ``--no-restore``; return its step
    (0 without one); each step skipped goes to ``on_skip(step_dir, reason)``.

    A step that verifies but cannot be restored here (an entry that does not fit: an RNG
    state of another size, a scheduler with other param groups; `refimpl.train._restorable`)
    is skipped like a damaged one, on every rank, and the step before it is tried."""
    rank, world = dist.get_rank(), dist.get_world_size()
    below: int | None = None
    digest: dict[str, str] = {}
    while True:
        digest.clear()
        found = load_latest(
            config.ckpt_dir,
            map_location=device,
            on_skip=on_skip,
            below=below,
            on_load=lambda _, m: digest.update(d=manifest_digest(m)),
        )
        # Every rank reads the directory itself; on nodes without a shared filesystem (or with
        # one that lags) they can see different steps, and would then train different models.
        check_same_checkpoint(
            None if found is None else found[0], digest.get("d"), ckpt_dir=config.ckpt_dir
        )
        if found is None:
            return 0
        step, state = found[0], dict(found[1])
        if "rng" in config.no_restore:
            state["rng"] = None
        why = _every_rank(_misfit(config, state, model, opt, rank, world))
        if why is None:
            # Checked before anything is restored: a flag that contradicts the step names the fix.
            problems = resume_problems(config, step, _base_lrs(state), _sampler(state))
            refuse(problems, rank, config.ckpt_dir)
            info, failed = _restore(config, state, model, opt, sched, sampler, rank, world)
            why = _every_rank(failed)
        if why is None:
            break
        on_skip(Path(config.ckpt_dir) / step_dir_name(step), f"verified, but {why}")
        below = step  # the older steps, restored over whatever this one had set
    if config.reset_lr:
        reset_lr(config, sched, opt, step, log)
    check_restored(sched, opt, step, config.ckpt_dir, flat=flat_schedule(config))
    if info["world_size"] != world:
        log(f"checkpoint is from {info['world_size']} ranks: RNG streams start afresh")
    return step


def _misfit(
    config: TrainConfig,
    state: Mapping[str, Any],
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    world: int,
) -> str | None:
    skip = config.no_restore
    why = misfit(
        state,
        model,
        opt,
        rank=rank,
        world_size=world,
        restore_rng="rng" not in skip,
        restore_optimizer="optimizer" not in skip,
    )
    return None if why is None else f"cannot be restored: {why}"


def _restore(
    config: TrainConfig,
    state: Mapping[str, Any],
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: LRScheduler,
    sampler: ResumableSampler,
    rank: int,
    world: int,
) -> tuple[dict[str, Any], str | None]:
    """Restore ``state``; return restore_state's info and what failed (None: nothing)."""
    optimizer = None if "optimizer" in config.no_restore else opt
    try:
        info = restore_state(state, model, optimizer, scheduler=sched, rank=rank, world_size=world)
        if "data" not in config.no_restore:
            sampler.load_state_dict(info["sampler"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return {}, f"cannot be restored on rank {rank} ({type(exc).__name__}: {exc})"
    return info, None


def _every_rank(mine: str | None) -> str | None:
    """Collective: the first rank's reason to skip the step, or None when no rank has one."""
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return next((why for why in found if why), None)


def _base_lrs(state: Mapping[str, Any]) -> list[float] | None:
    saved = state.get("scheduler")
    base = saved.get("base_lrs") if isinstance(saved, Mapping) else None
    return [float(lr) for lr in base] if isinstance(base, list) else None


def _sampler(state: Mapping[str, Any]) -> Mapping[str, Any] | None:
    saved = state.get("sampler")
    return saved if isinstance(saved, Mapping) else None


def final_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights to publish, without DDP's ``module.`` prefix (no collective)."""
    return unwrap_state_dict(model)
