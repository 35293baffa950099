"""Whether a verified step's content fits the trainer it is restored into.

Digests prove that a step holds the bytes that were saved, not that those bytes can be
restored: a step edited by hand or written by another version of a trainer verifies, and
then an RNG state of the wrong size (``torch.set_rng_state`` refuses it) or a scheduler with
other param groups (its rates no longer pair with the optimizer's groups) crashed every
restart, although an older good step sat on disk. `misfit` names the entry that does not fit
before anything is restored, so `refimpl.train` falls back to the step before it (the reason
logged) the way it falls back past a damaged one.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

from refimpl.state import unwrap_state_dict


def _rng_misfit(rng: Any, where: str) -> str | None:
    """Why one rank's `refimpl.state.capture_rng` entry cannot be restored here, or None."""
    if not isinstance(rng, Mapping):
        return f"{where} is a {type(rng).__name__}, not an RNG state"
    state = rng.get("torch")
    want = torch.get_rng_state().numel()
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() != want:
        got = f"{state.numel()} x {state.dtype}" if isinstance(state, torch.Tensor) else "no tensor"
        return f"{where}['torch'] holds {got}; this torch's generator state is {want} x uint8"
    py = rng.get("python")
    internal = py.get("internal") if isinstance(py, Mapping) else None
    words = len(random.getstate()[1])
    if isinstance(internal, torch.Tensor) and internal.numel() != words:
        return f"{where}['python'] holds {internal.numel()} words; Python's generator has {words}"
    numpy = rng.get("numpy")
    keys = numpy.get("keys") if isinstance(numpy, Mapping) else None
    if isinstance(keys, torch.Tensor) and keys.numel() != 624:
        return f"{where}['numpy'] holds {keys.numel()} keys; numpy's MT19937 has 624"
    return None


def scheduler_misfit(saved: Any, opt: torch.optim.Optimizer) -> str | None:
    """Why a saved LR scheduler state does not pair with ``opt``'s param groups, or None."""
    if saved is None:
        return None
    base = saved.get("base_lrs") if isinstance(saved, Mapping) else None
    if not isinstance(base, list):
        return "the 'scheduler' entry has no base_lrs list"
    if len(base) != len(opt.param_groups):
        return (
            f"the 'scheduler' entry has {len(base)} param group(s), this optimizer "
            f"{len(opt.param_groups)}"
        )
    return None


def misfit(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    rank: int,
    world_size: int,
    restore_rng: bool,
    restore_optimizer: bool,
) -> str | None:
    """The first entry of a file checkpoint's ``state`` that cannot be restored into these
    objects on ``rank``, named with the reason; None when every entry fits."""
    saved = state.get("model")
    if not isinstance(saved, Mapping):
        return "the 'model' entry is not a state dict"
    mine = unwrap_state_dict(model)
    if set(saved) != set(mine):
        odd = sorted(set(saved) ^ set(mine))[:4]
        return f"the 'model' entry's keys differ from the model's (e.g. {odd})"
    for key, value in mine.items():
        if not isinstance(saved[key], torch.Tensor) or saved[key].shape != value.shape:
            got = getattr(saved[key], "shape", type(saved[key]).__name__)
            return f"the 'model' entry's {key} is {got}, the model's {tuple(value.shape)}"
    if restore_optimizer:
        saved_opt = state.get("optimizer")
        groups = saved_opt.get("param_groups") if isinstance(saved_opt, Mapping) else None
        sizes = [len(g["params"]) for g in opt.param_groups]
        if (
            not isinstance(groups, list)
            or [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in groups] != sizes
        ):
            return "the 'optimizer' entry's param groups differ from this optimizer's"
    why = scheduler_misfit(state.get("scheduler"), opt)
    if why:
        return why
    rng = state.get("rng")
    if restore_rng and isinstance(rng, list) and len(rng) == world_size and rank < len(rng):
        return _rng_misfit(rng[rank], f"the 'rng' entry of rank {rank}")
    return None
