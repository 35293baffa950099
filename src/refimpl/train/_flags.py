"""A resumed ``refimpl.train`` run's flags against the checkpoint it resumes.

A restart passes the command line again, and a changed flag used to be ignored or to change
the run without a word: another ``--lr`` trained at the checkpoint's rate (the scheduler's
saved ``base_lrs`` win), ``--steps`` below the committed step said "done", another
``--samples`` continued the saved position in another dataset, and another ``--seed`` was
refused by the sampler, in its own words, after the model had been restored. Each is now
checked against the step before anything is restored (`resume_problems`), and refused with
the flag to pass; ``--reset-lr`` applies a new ``--lr`` instead, and says so (`reset_lr`).

The trainer's saved sampler entry carries ``"samples"`` (the dataset size its position
counts in) beside the sampler's own ``seed``, ``epoch`` and ``position``, on both backends;
a step saved before it was added is not checked for ``--samples``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from refimpl.train._config import TrainConfig
from refimpl.train._schedule import lr_factor


def sampler_entry(config: TrainConfig, position: Mapping[str, int]) -> dict[str, int]:
    """The sampler state a checkpoint holds: the position and the dataset size it counts in."""
    return {**position, "samples": int(config.samples)}


def resume_problems(
    config: TrainConfig,
    step: int,
    base_lrs: Sequence[float] | None,
    sampler: Mapping[str, Any] | None,
) -> list[str]:
    """What in ``config`` contradicts the step being resumed (``step``, its scheduler's
    ``base_lrs``, its sampler entry), each with the flag to pass; empty when nothing does."""
    problems = []
    if step > config.steps:
        problems.append(
            f"step_{step} is past --steps {config.steps}: the run already trained {step} steps. "
            f"Pass --steps {step} or more to continue it, or another --ckpt-dir for a new run"
        )
    saved_lr = float(base_lrs[0]) if base_lrs else None
    if saved_lr is not None and saved_lr != config.lr and not config.reset_lr:
        problems.append(
            f"step_{step} was trained at lr {saved_lr:g}, not --lr {config.lr:g}: pass --lr "
            f"{saved_lr:g}, or --reset-lr to apply the new one"
        )
    sampler = sampler or {}
    seed = sampler.get("seed")
    if type(seed) is int and seed != config.seed:
        problems.append(
            f"step_{step} was trained with --seed {seed} (its weights, sample order and "
            f"dropout streams), not --seed {config.seed}: pass --seed {seed}, or another "
            "--ckpt-dir for a new run"
        )
    samples = sampler.get("samples")
    if type(samples) is int and samples != config.samples:
        problems.append(
            f"step_{step} was trained on --samples {samples}, not --samples {config.samples}: "
            f"its data position (epoch {sampler.get('epoch')}, sample "
            f"{sampler.get('position')}) counts in that dataset. Pass --samples {samples}, "
            "or another --ckpt-dir for a new run"
        )
    return problems


def refuse(problems: Sequence[str], rank: int, ckpt_dir: str) -> None:
    """Raise one error holding every problem, naming the rank and the directory."""
    if problems:
        raise RuntimeError(
            f"rank {rank}: {ckpt_dir}: the command line does not match the run it resumes, "
            "nothing was trained: " + "; ".join(problems)
        )


def reset_lr(
    config: TrainConfig,
    sched: LRScheduler,
    opt: torch.optim.Optimizer,
    step: int,
    log: Callable[[str], None],
) -> None:
    """``--reset-lr``: the restored scheduler takes ``--lr`` as its base rate from ``step``
    on (the schedule's multiplier is unchanged), and the optimizer's groups follow."""
    old = [float(lr) for lr in sched.base_lrs]
    if all(lr == config.lr for lr in old):
        return
    factor = lr_factor(config.lr_schedule, config.warmup_steps, config.steps)(step)
    state = sched.state_dict()
    state["base_lrs"] = [config.lr] * len(old)
    state["_last_lr"] = [config.lr * factor] * len(old)
    sched.load_state_dict(state)
    for group in opt.param_groups:
        group["initial_lr"] = config.lr
    log(f"--reset-lr: step_{step} was trained at lr {old[0]:g}; training on at --lr {config.lr:g}")
