"""``python -m refimpl.train --sharded --async-save``: the save of step N overlaps the next steps.

`refimpl.sharded.AsyncSaver` does the work: ``save`` first waits for the save still in flight
(so at most one is), copies this rank's shard of the model and optimizer to CPU staging
buffers and serialises ``state=`` during the call, and writes and commits on its own gloo
group in a thread while training goes on. The trainer waits for the last save before it
writes the final weights and before it exits 0 after SIGTERM: a preempted job's newest step
must be on disk when the process leaves. A save that failed raises at the next wait, on
every rank, and the worker exits non-zero (torchrun restarts from the last committed step).

A kill while a save is in flight loses that step only: nothing is published before every
rank's files are durable, so the restart resumes from the one before, bit-identically.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from refimpl.sharded import AsyncSaver
from refimpl.train._config import TrainConfig
from refimpl.train._flags import sampler_entry
from refimpl.train._sharded import trainer_state


class AsyncSaves:
    """`refimpl.train._sharded.save`'s signature, in the background; ``close`` at the end.

    Create it on every rank (the saver's process group is made collectively)."""

    def __init__(self, config: TrainConfig, log: Callable[[str], None]) -> None:
        self._saver = AsyncSaver(timeout_s=config.save_timeout)
        self._log = log
        self._rank = dist.get_rank()

    def _wait(self) -> None:
        path = self._saver.wait()  # raises the save's error on every rank
        if path is not None and self._rank == 0:
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
        """Wait for the save in flight, then start this one and return once it is staged."""
        self._wait()
        state = trainer_state(sched, sampler_entry(config, sampler_state), step)
        self._saver.save(config.ckpt_dir, model, opt, step, keep_last=config.keep_last, state=state)
        if self._rank == 0:
            log(f"saving step {step} in the background")

    def close(self) -> None:
        """Wait for the last save to commit (or raise its error), then free the staging."""
        try:
            self._wait()
        finally:
            self._saver.close()
