"""The whole training state, in a form ``torch.load(weights_only=True)`` rebuilds.

A resume that is exact needs more than the weights: the optimizer's moments, the LR
scheduler, the GradScaler, every RNG (python, numpy, torch), the sampler's position, the
epoch/step and the world size it was saved at. `capture_state` gathers them into plain
containers of tensors and numbers (numpy's RNG state holds an ndarray, which the weights-only
unpickler refuses, so its key array is stored as a tensor) and `restore_state` puts them
back. `unwrap_state_dict` removes the ``module.`` prefix DDP adds (and ``_orig_mod.`` from
``torch.compile``), so the state loads into a bare model on any number of ranks.
`export_safetensors` writes the inference weights: half precision, no optimizer, no pickle.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "capture_rng",
    "capture_state",
    "export_safetensors",
    "restore_rng",
    "restore_state",
    "unwrap_state_dict",
]

_PREFIXES = ("module.", "_orig_mod.")


def unwrap_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with DDP's ``module.`` (and compile's ``_orig_mod.``) removed.

    Example: ``unwrap_state_dict(DDP(net))`` has the keys of ``net.state_dict()``.
    """
    inner = getattr(model, "module", model)
    out: dict[str, torch.Tensor] = {}
    for key, value in inner.state_dict().items():
        while key.startswith(_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch (and CUDA, if used) RNG states, weights-only loadable.

    Example: ``s = capture_rng(); a = torch.rand(1); restore_rng(s); torch.rand(1) == a``.
    """
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        # Python's Mersenne Twister: 624 words + position. Kept as a tensor, not a tuple of ints:
        # pickle sizes an int by its value, so a tuple would make every checkpoint a different size.
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what `capture_rng` captured (after a weights-only load)."""
    py = state["python"]
    if isinstance(py, Mapping):
        random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss"]))
    else:  # refimpl 0.1.0 checkpoints stored getstate()'s tuple as is
        version, internal, gauss = py
        random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    sampler_state: Mapping[str, int] | None = None,
    rng: Any = None,
    epoch: int = 0,
    step: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    """Everything an exact resume needs, as one weights-only-loadable dict.

    ``rng`` is what `capture_rng` returned, or a list of them (one per rank, gathered by the
    trainer), or None for this process's. Example::

        state = capture_state(ddp_model, opt, scheduler=sched, scaler=scaler,
                              sampler_state=sampler.state_dict(batches_done=k),
                              epoch=0, step=k, world_size=2)
        save_checkpoint(ckpt_dir, state, step=k)
    """
    return {
        "model": unwrap_state_dict(model),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "sampler": dict(sampler_state) if sampler_state is not None else None,
        "rng": rng if rng is not None else capture_rng(),
        "epoch": int(epoch),
        "step": int(step),
        "world_size": int(world_size),
    }


def restore_state(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    rank: int = 0,
    world_size: int | None = None,
) -> dict[str, Any]:
    """Load ``state`` into the given objects; return ``{"epoch", "step", "world_size",
    "sampler"}``.

    The model may be DDP-wrapped or bare (the saved keys are unwrapped). RNG: a list of
    per-rank states is restored on the same world size only (rank ``rank`` takes its own);
    a single state is restored as is. Load the file on every rank with
    ``safe_load(path, map_location=rank_device())``. Example::

        info = restore_state(safe_load(path), ddp_model, opt, scheduler=sched, rank=rank)
        sampler.load_state_dict(info["sampler"])
    """
    getattr(model, "module", model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    rng = state.get("rng")
    if isinstance(rng, list):
        if world_size in (None, len(rng)) and rank < len(rng):
            restore_rng(rng[rank])
    elif rng is not None:
        restore_rng(rng)
    return {
        "epoch": int(state["epoch"]),
        "step": int(state["step"]),
        "world_size": int(state["world_size"]),
        "sampler": state.get("sampler"),
    }


def export_safetensors(
    model: torch.nn.Module, path: str | os.PathLike[str], dtype: torch.dtype = torch.float16
) -> Path:
    """Write the inference weights (unwrapped, floating tensors cast to ``dtype``) atomically.

    safetensors stores a JSON header and raw bytes: loading it runs no code. Example:
    ``export_safetensors(ddp_model, "model.safetensors")`` then
    ``safetensors.torch.load_file("model.safetensors")``.
    """
    from safetensors.torch import save

    from refimpl.atomic import atomic_write_bytes

    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous().clone()
        for k, v in unwrap_state_dict(model).items()
    }
    return atomic_write_bytes(save(tensors), path)
