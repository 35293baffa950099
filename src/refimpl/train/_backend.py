"""The trainer's checkpoint backends behind one interface: `Backend`, and `Saves` for saving.

Two backends implement `Backend`, each as a module of functions: `refimpl.train._files`
(DDP; rank 0 writes one file checkpoint) and `refimpl.train._sharded` (FSDP2; every rank
writes its shard of a DCP checkpoint). ``--async-save`` replaces the backend's own saves with
an object that writes in the background (`refimpl.train._files.AsyncFileSaves`,
`refimpl.train._async.AsyncSaves`), which implements `Saves`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler

from refimpl.data import ResumableSampler
from refimpl.train._config import TrainConfig

__all__ = ["Backend", "Log", "Saves", "backend", "saves"]

Log = Callable[[str], None]
"""Where the trainer's ``[rankR] ...`` lines go."""


class Saves(Protocol):
    """Saving checkpoints of one run, step after step."""

    def save(
        self,
        config: TrainConfig,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        sched: LRScheduler,
        sampler_state: Mapping[str, int],
        step: int,
        log: Log,
    ) -> None:
        """Collective: save ``step`` (``sampler_state``: the batches' position after it) under
        ``config.ckpt_dir``, keeping ``config.keep_last``; raises what the write raised (a
        background save: at a later `save` or `close`)."""
        ...

    def close(self) -> None:
        """Return once every save has committed (raising a failed one's error)."""
        ...


class Backend(Saves, Protocol):
    """Where a run's model is wrapped, saved and restored from."""

    def wrap_model(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """Collective: the model on ``device``, wrapped for data parallel training."""
        ...

    def seed_step(self, seed: int, rank: int, step: int) -> None:
        """Before ``step``: seed this rank's dropout stream, if the backend saves none."""
        ...

    def load(
        self,
        config: TrainConfig,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        sched: LRScheduler,
        sampler: ResumableSampler,
        device: torch.device,
        log: Log,
        on_skip: Callable[[Path, str], None],
    ) -> int:
        """Collective: restore the newest step that fits; return it (0: none). Each step
        skipped goes to ``on_skip``; a flag that contradicts the step raises."""
        ...

    def final_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Collective: the full weights, without wrapper prefixes."""
        ...


def backend(config: TrainConfig) -> Backend:
    """The backend ``config.sharded`` picks."""
    if not config.sharded:
        import refimpl.train._files as file_backend

        return file_backend
    # Imported only here: torch.distributed.checkpoint and DTensor add a large share of every
    # worker's start-up CPU, and a torchrun restart pays it again on every rank.
    import refimpl.train._sharded as sharded_backend

    return sharded_backend


def saves(config: TrainConfig, chosen: Backend, log: Log) -> Saves:
    """What saves each step: ``chosen`` itself, or with ``--async-save`` a background saver
    (create it after the load: a restart's first save must not race it)."""
    if not config.async_save:
        return chosen
    if config.sharded:
        from refimpl.train._async import AsyncSaves

        return AsyncSaves(config, log)
    from refimpl.train._files import AsyncFileSaves

    return AsyncFileSaves(config, log)
