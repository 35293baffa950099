"""Chapter 12: the whole state of every rank, captured into one file checkpoint and restored.

A DDP job whose rank 0 writes the checkpoint has one problem `refimpl.state` cannot solve
alone: the RNG streams live in every process (dropout masks differ by rank; a script that
draws its batches with ``torch.randint`` draws them from its own stream), and rank 0 cannot
read another process's generator. The three functions here are the collective parts:

- `capture_every_rank`: every rank calls it at the same point of the loop; each rank's RNG is
  gathered to rank 0, which gets the whole state (`refimpl.state.capture_state`) to save;
- `resume_every_rank`: every rank loads the newest checkpoint that verifies
  (`refimpl.checkpoint.load_latest`), the ranks check that they found the same one, and each
  restores the weights, the optimizer, the sampler and *its own* RNG stream;
- `check_same_checkpoint`: that check on its own, for a trainer that loads by itself.

Saving stays the trainer's: rank 0 passes the captured state to
`refimpl.checkpoint.save_checkpoint`, inside `refimpl.sync.main_process_first` so the other
ranks wait for it under a save timeout. A sharded (FSDP) trainer uses `refimpl.sharded` instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refimpl._step_dirs import log_skip
from refimpl.atomic import COMMIT_MARKER
from refimpl.checkpoint import CheckpointError, load_latest
from refimpl.data import ResumableSampler
from refimpl.state import capture_grads, capture_rng, capture_state, restore_state

__all__ = [
    "CheckpointMismatch",
    "Resumed",
    "capture_every_rank",
    "check_same_checkpoint",
    "manifest_digest",
    "resume_every_rank",
]


def _world() -> tuple[int, int]:
    """(rank, world size), or (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def capture_every_rank(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    sampler_state: Mapping[str, int] | None = None,
    epoch: int = 0,
    step: int = 0,
    micro_step: int = 0,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Collective: the training state of every rank at this point; rank 0 gets it, others None.

    Each rank's RNG state (`refimpl.state.capture_rng`) is gathered to rank 0, which returns
    `refimpl.state.capture_state` with ``rng`` the list of them in rank order and
    ``world_size`` the group's; ``extra`` holds your own keys (see ``capture_state``). Without
    a process group it is ``capture_state`` with this process's RNG, as a list of one.

    ``scaler`` (a ``torch.amp.GradScaler``) saves its scale and growth tracker, so a resumed
    fp16 run continues at the scale it had reached instead of the initial 65536. With gradient
    accumulation, ``micro_step`` is how many micro-batches of the next optimizer step are
    already in ``.grad``: 0 (the default) at a step boundary; above 0, every rank's
    gradients (`refimpl.state.capture_grads`: under DDP's ``no_sync`` each rank's own) are
    gathered to rank 0 like the RNG and saved, and ``sampler_state`` must be the position of
    the next micro-batch. Such a state resumes only at the same world size; saving at step
    boundaries avoids both the gradients' size and that limit.

    Where to call it: on every rank, at the same point of the loop, and *before* any work
    that only rank 0 does (an evaluation, logging, the save itself). Two reasons. It is a
    collective: called inside ``if rank == 0:`` it waits for ranks that never come. And a
    resumed run re-enters the loop at this point and re-runs what follows it, so the state
    must be the one *before* that work: an evaluation on rank 0 that draws random batches
    moves rank 0's RNG, and a state captured after it would, on resume, see that evaluation
    run again from the moved stream and train with different dropout masks (chapter 12
    measures it). Pass the position of the batch this iteration will train
    (`refimpl.data.ResumableBatches` hands it out with the batch) as ``sampler_state``.

    The weights and the optimizer state are the live tensors, not copies: rank 0 must save
    the returned dict before the next ``optimizer.step()``. Example::

        state = capture_every_rank(model, opt, sampler_state=position, step=it,
                                   extra={"best_val_loss": best})
        with main_process_first(timeout_s=600) as is_main:
            if is_main:
                evaluate(unwrap_model(model))    # rank 0 only, after the capture: the
                save_checkpoint("ckpt", state, it)   # bare model (a DDP forward is collective)
    """
    rank, world = _world()
    mine = (capture_rng(), capture_grads(model) if micro_step else None)
    if world == 1:
        both: list[Any] = [mine]
    else:
        both = [None] * world
        dist.gather_object(mine, both if rank == 0 else None, dst=0)
        if rank != 0:
            return None
    rngs = [r for r, _ in both]
    grads = [g for _, g in both] if micro_step else None
    return capture_state(
        model,
        optimizer,
        scheduler=scheduler,
        scaler=scaler,
        sampler_state=sampler_state,
        rng=rngs,
        epoch=epoch,
        step=step,
        world_size=world,
        micro_step=micro_step,
        grads=grads,
        extra=extra,
    )


class CheckpointMismatch(RuntimeError):
    """The ranks resumed different checkpoints. ``seen[r]`` is rank r's ``(step, digest)``."""

    def __init__(self, message: str, seen: list[tuple[int | None, str | None]]) -> None:
        super().__init__(message)
        self.seen = seen


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """A short digest of a step's manifest (what ``load_latest``'s ``on_load`` receives).

    The manifest lists every file's size and content digest, so two ranks with the same
    digest hold the same bytes; the sha256 of its JSON with sorted keys, first 16 hex digits.
    """
    text = json.dumps(manifest, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_same_checkpoint(
    step: int | None, digest: str | None = None, *, ckpt_dir: str | os.PathLike[str] = ""
) -> None:
    """Collective: raise `CheckpointMismatch` on every rank unless all resumed the same step.

    Every rank passes the step it loaded (None: it found none) and the `manifest_digest` of
    that step's manifest; the ranks all-gather them and compare. On nodes without a shared
    filesystem, or with one that lags, ranks can see different newest steps, or different
    copies of one step, and would then train different models in silence. A no-op without a
    process group. ``ckpt_dir`` only goes into the message. Example::

        seen = {}
        found = load_latest("ckpt", on_load=lambda d, m: seen.update(digest=manifest_digest(m)))
        step = None if found is None else found[0]
        check_same_checkpoint(step, seen.get("digest"), ckpt_dir="ckpt")
    """
    rank, world = _world()
    if world == 1:
        return
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, (step, digest))
    views = [tuple(v) for v in seen]
    if len(set(views)) > 1:
        where = f" in {ckpt_dir}" if str(ckpt_dir) else ""
        by_rank = ", ".join(
            f"rank {r}: step {s} ({d or 'no manifest'})" for r, (s, d) in enumerate(views)
        )
        raise CheckpointMismatch(
            f"rank {rank}: ranks found different latest checkpoints{where} ({by_rank}). Put the "
            "checkpoint directory on a filesystem every node sees, the same for every rank.",
            [(s, d) for s, d in views],
        )


def _refuse_to_start_over(ckpt_dir: str | os.PathLike[str], why: str | None, world: int) -> None:
    """Raise on every rank if any rank found committed steps it could not load."""
    seen: list[Any] = [why]
    if world > 1:
        seen = [None] * world
        dist.all_gather_object(seen, why)  # each rank read its own listing: stop together
    if reasons := next((w for w in seen if w), None):
        raise CheckpointError(
            ckpt_dir,
            f"holds committed steps but none of them loads ({reasons}). Starting from step 0 "
            "would train over them and, as saves prune old steps, delete them: fix what the "
            "reasons say, or move the steps away to start a new run",
        )


@dataclass
class Resumed:
    """What `resume_every_rank` restored: the step, the saved epoch and world size, the
    sampler state (already loaded into ``sampler`` when one was passed), your own keys
    (``extra``), whether this rank's RNG stream was restored, the step's manifest digest, and
    ``micro_step``: the micro-batches of the next optimizer step already accumulated (and
    restored into ``.grad``), 0 for a state saved at a step boundary."""

    step: int
    epoch: int
    world_size: int
    sampler: dict[str, int] | None
    extra: dict[str, Any] = field(default_factory=dict)
    rng_restored: bool = False
    digest: str = ""
    micro_step: int = 0


def resume_every_rank(
    ckpt_dir: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: ResumableSampler | None = None,
    map_location: Any = "cpu",
    on_skip: Callable[[Path, str], None] | None = None,
) -> Resumed | None:
    """Collective: restore the newest good checkpoint of ``ckpt_dir`` on every rank, or None.

    Every rank runs `refimpl.checkpoint.load_latest` (a torn or corrupt newest step is skipped
    and reported to ``on_skip``), then `check_same_checkpoint` (every rank must hold the same
    step with the same manifest, or all raise `CheckpointMismatch`), then
    `refimpl.state.restore_state`: the weights (DDP-wrapped or not), the optimizer, scheduler
    and scaler when given, the sampler's position into ``sampler``, and this rank's own RNG
    stream from the list `capture_every_rank` saved. The world-size rule: the sampler's
    position carries over to any world size (`refimpl.data.ResumableSampler`), the RNG
    streams only to the world size they were saved at; at another one every rank keeps the
    stream it seeded itself and ``rng_restored`` is False. Returns None (on every rank) when
    there is no checkpoint. When committed steps exist but none of them loads, it raises
    `refimpl.checkpoint.CheckpointError` on every rank with each step's reason, instead of
    returning None: a run that started over would train from step 0 and save over them.
    Call it after seeding, before the loop. Example::

        resumed = resume_every_rank("ckpt", model, opt, sampler=sampler)
        start = 0 if resumed is None else resumed.step
        best = float("inf") if resumed is None else resumed.extra["best_val_loss"]
    """
    rank, world = _world()
    loaded: dict[str, str] = {}
    unloadable: list[str] = []

    def remember(step_dir: Path, manifest: dict[str, Any]) -> None:
        loaded["digest"] = manifest_digest(manifest)

    def skipped(step_dir: Path, why: str) -> None:
        if (step_dir / COMMIT_MARKER).is_file():  # a step a save finished, now unloadable
            unloadable.append(f"{step_dir.name}: {why}")
        (on_skip or log_skip)(step_dir, why)

    found = load_latest(ckpt_dir, on_skip=skipped, map_location=map_location, on_load=remember)
    check_same_checkpoint(
        None if found is None else found[0], loaded.get("digest"), ckpt_dir=ckpt_dir
    )
    if found is None:
        _refuse_to_start_over(ckpt_dir, "; ".join(unloadable) or None, world)
        return None
    info = restore_state(
        found[1], model, optimizer, scheduler=scheduler, scaler=scaler, rank=rank, world_size=world
    )
    if sampler is not None and info["sampler"] is not None:
        sampler.load_state_dict(info["sampler"])
    return Resumed(
        step=info["step"],
        epoch=info["epoch"],
        world_size=info["world_size"],
        sampler=info["sampler"],
        extra=info["extra"],
        rng_restored=info["rng_restored"],
        digest=loaded["digest"],
        micro_step=info["micro_step"],
    )
