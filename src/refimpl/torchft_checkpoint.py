"""Chapter 13: refimpl checkpoints and data order for a torchft job.

torchft {cite}`torchft` keeps a job stepping while a replica group is replaced, and heals the
newcomer from a live peer; it does not survive the loss of *every* group (the whole job
killed, a scheduler's requeue), and it cannot change a group's own world size. Periodic
refimpl checkpoints cover those. Three pieces glue the two together, without importing torchft
(anything with the `StepManager` methods works, `torchft.Manager` included):

- `batch_for_step`: the samples a replica group trains at a committed step, a pure function of
  the step, so a group that heals to step S trains step S's batch, and the batches of a
  missing group are known (the chapter counts them);
- `save_ft_checkpoint`: a checkpoint with the manager's own state (its step and batch count),
  written by one group only, after a committed step;
- `load_ft_checkpoint`: at start-up, the newest checkpoint, the manager's state restored with
  it. Every group loads it; the quorum then heals whichever group is behind from a peer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from refimpl.checkpoint import CheckpointError, load_latest, save_checkpoint, step_dir_name
from refimpl.data import ResumableSampler

__all__ = [
    "MANAGER_KEY",
    "StepManager",
    "batch_for_step",
    "load_ft_checkpoint",
    "save_ft_checkpoint",
]

MANAGER_KEY = "torchft"
"""The checkpoint key (file ``torchft.pt``) that holds the manager's ``state_dict()``."""


class StepManager(Protocol):
    """What the glue uses of ``torchft.Manager`` (the same method names and meanings)."""

    def current_step(self) -> int: ...

    def participating_rank(self) -> int | None: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state_dict: dict[str, int]) -> None: ...


def batch_for_step(
    step: int,
    *,
    replica: int,
    replicas: int,
    dataset_len: int,
    batch_size: int,
    seed: int = 0,
) -> list[int]:
    """The ``batch_size`` sample indices group ``replica`` trains at committed step ``step``.

    Step ``step`` (0-based: the manager's ``current_step()`` before the step) draws the
    ``step``-th global batch of ``replicas * batch_size`` samples of a `ResumableSampler`
    stream (epoch after epoch, the sampler's permutation per epoch); group ``replica`` takes
    its share. ``replicas`` is the most groups the job runs, fixed for the job: with fewer
    present, the absent groups' shares are not trained at that step. Raises ValueError for a
    negative step, a replica outside ``0..replicas-1``, or a dataset smaller than one global
    batch. Why a function of the step: a healed group jumps to its peer's step and must train
    that step's batch, with no data-loader state to transfer.
    """
    if step < 0:
        raise ValueError(f"replica {replica}: step must be >= 0, got {step}")
    global_batch = replicas * batch_size
    per_epoch = dataset_len // global_batch
    if per_epoch < 1:
        raise ValueError(
            f"replica {replica}: a dataset of {dataset_len} samples is smaller than one global "
            f"batch ({replicas} replica groups x {batch_size}); use more samples or smaller batches"
        )
    sampler = ResumableSampler(
        dataset_len, batch_size=batch_size, rank=replica, world_size=replicas, seed=seed
    )
    sampler.load_state_dict(
        {"seed": seed, "epoch": step // per_epoch, "position": (step % per_epoch) * global_batch}
    )
    it = iter(sampler)
    return [next(it) for _ in range(batch_size)]


def save_ft_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    manager: StepManager,
    state: Mapping[str, Any],
    *,
    every: int,
    keep_last: int = 3,
) -> Path | None:
    """After a committed step, save ``state`` plus the manager's state if it is this group's turn.

    Saves (with `refimpl.checkpoint.save_checkpoint`, as ``step_N`` for the manager's current
    step N) only when N > 0, N is a multiple of ``every``, and this group has participating
    rank 0 in the current quorum: exactly one group writes, the others return None. Call it
    on every rank of that group only if they share nothing (here: one rank per group). Raises
    ValueError if ``every`` < 1 or ``state`` already has the key `MANAGER_KEY`, and
    `refimpl.checkpoint.CheckpointError` if the save fails. Why the manager's state: without
    its step, a job restarted from the checkpoint would count steps (and pick batches) from 0.
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if MANAGER_KEY in state:
        raise ValueError(f"state must not have the key {MANAGER_KEY!r}: the manager's goes there")
    step = manager.current_step()
    if step == 0 or step % every or manager.participating_rank() != 0:
        return None
    return save_checkpoint(
        ckpt_dir, {**state, MANAGER_KEY: manager.state_dict()}, step, keep_last=keep_last
    )


def load_ft_checkpoint(
    ckpt_dir: str | os.PathLike[str], manager: StepManager
) -> tuple[int, dict[str, Any]] | None:
    """Restore the manager from the newest checkpoint in ``ckpt_dir``; return ``(step, state)``.

    Returns None when ``ckpt_dir`` holds no checkpoint (a fresh start), else the step and the
    checkpoint's state (the caller loads its model and optimizer from it) after calling
    ``manager.load_state_dict`` with the saved manager state. Raises
    `refimpl.checkpoint.CheckpointError` when the checkpoint has no `MANAGER_KEY` (it was not
    written by `save_ft_checkpoint`). Damaged steps are skipped as in
    `refimpl.checkpoint.load_latest`. Why every group calls it: the quorum's heal brings any
    group that started from an older checkpoint (or none) to the newest step.
    """
    found = load_latest(ckpt_dir)
    if found is None:
        return None
    step, state = found
    if MANAGER_KEY not in state:
        raise CheckpointError(
            Path(ckpt_dir) / step_dir_name(step),
            f"has no {MANAGER_KEY!r} entry, so it was not written by save_ft_checkpoint; "
            "restore it with refimpl.checkpoint.load_latest instead",
        )
    manager.load_state_dict(state[MANAGER_KEY])
    return step, state
