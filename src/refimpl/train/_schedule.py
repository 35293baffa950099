"""``python -m refimpl.train --lr-schedule``: linear warmup, then constant or cosine decay.

The schedule is a ``torch.optim.lr_scheduler.LambdaLR`` stepped once per optimizer step, so
after step ``s`` its ``last_epoch`` is ``s``. Its state dict (``last_epoch``, ``base_lrs``,
``_last_lr``; the multiplier itself is a closure, which LambdaLR leaves out) rides in the
checkpoint on both backends: the file backend's ``scheduler`` key
(`refimpl.state.capture_state`), the sharded backend's ``state=`` entry ``"scheduler"``
(`refimpl.sharded.save_sharded`). The multiplier is a pure function of the step and the
command line, so a resumed run with the same flags takes the same learning rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from refimpl.train._config import TrainConfig

MIN_LR_RATIO = 0.1
"""Where the cosine ends, as a fraction of ``--lr`` (the usual floor of LLM recipes)."""


def lr_factor(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """The multiplier of ``--lr`` for the optimizer step taken at scheduler step ``s``.

    ``s`` counts steps already taken (0 for the first). Warmup rises linearly to 1 over
    ``warmup`` steps (the first step uses ``1 / warmup``, never 0: a step at lr 0 is wasted);
    then ``"constant"`` stays at 1 and ``"cosine"`` falls along half a cosine from 1 at step
    ``warmup`` to `MIN_LR_RATIO` at step ``total``, and stays there after.
    """
    if kind not in ("constant", "cosine"):
        raise ValueError(f"unknown schedule {kind!r}: pass 'constant' or 'cosine'")

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def flat_schedule(config: TrainConfig) -> bool:
    """Whether ``config`` ask for a multiplier of 1 at every step (the default)."""
    return bool(config.lr_schedule == "constant" and config.warmup_steps == 0)


def make_scheduler(opt: torch.optim.Optimizer, kind: str, warmup: int, total: int) -> LambdaLR:
    """The trainer's scheduler on ``opt``; call its ``step()`` after each ``opt.step()``.

    Built before any checkpoint is loaded, as LambdaLR requires (it records each group's
    ``initial_lr`` and sets the step-0 rate); a load then replaces its counters.
    """
    return LambdaLR(opt, lr_factor(kind, warmup, total))


def check_restored(
    sched: LRScheduler, opt: torch.optim.Optimizer, step: int, ckpt: str, *, flat: bool
) -> None:
    """After a load at ``step``: the scheduler must stand at ``step``; the optimizer's rates
    are set from it. ``flat``: the multiplier is 1 at every step (constant, no warmup).

    A checkpoint written before schedules were saved leaves ``last_epoch`` at 0. With a flat
    schedule that changes nothing, and the counter is moved to ``step``; with any other,
    resuming would replay the warmup or the decay from its start: refused.
    The rates are set here because the optimizer's own saved rates are not restored under
    ``--no-restore optimizer``, and the next step must use the schedule's rate regardless.
    """
    if sched.last_epoch != step and flat:
        sched.last_epoch = step
    if sched.last_epoch != step:
        raise RuntimeError(
            f"{ckpt}: step_{step} holds an LR schedule at step {sched.last_epoch}: it was "
            "saved without one (an older refimpl.train); resume it with "
            "--lr-schedule constant --warmup-steps 0, or start a new --ckpt-dir"
        )
    for group, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
        group["lr"] = lr
