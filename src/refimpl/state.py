"""The whole training state, in a form ``torch.load(weights_only=True)`` rebuilds.

A resume that is exact needs more than the weights: the optimizer's moments, the LR
scheduler, the GradScaler, every RNG (python, numpy, torch), the sampler's position, the
epoch/step and the world size it was saved at. `capture_state` gathers them into plain
containers of tensors and numbers (numpy's RNG state holds an ndarray, which the weights-only
unpickler refuses, so its key array is stored as a tensor) and `restore_state` puts them
back. `unwrap_state_dict` removes the ``module.`` prefix DDP adds (and ``_orig_mod.`` from
``torch.compile``), so the state loads into a bare model on any number of ranks, and
`restore_state` loads it through the same wrappers (`unwrap_model`): a compiled model's state
into an uncompiled one and back.

The GradScaler (``scaler``: its scale and growth tracker, so a resumed fp16 run does not
restart at scale 65536) and the gradient-accumulation position (``micro_step``: micro-batches
already accumulated into ``.grad`` for the next optimizer step, with those gradients under
``grads``) are part of the state like the optimizer's.
`export_safetensors` writes the inference weights: half precision, no optimizer, no pickle.

Your own keys (the best validation loss, the model's configuration) travel in the same dict:
``capture_state(..., extra={"best_val_loss": 1.2})`` adds them next to `STATE_KEYS`, and
`restore_state` hands them back under ``"extra"``. A trainer with several ranks captures and
restores through `refimpl.trainstate`, which gathers every rank's RNG into one state.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from refimpl._manifest import KEY_RE  # the file names save_checkpoint accepts
from refimpl._weights import WRAPPER_PREFIXES, inference_tensor

__all__ = [
    "ACCUMULATION_KEYS",
    "STATE_KEYS",
    "capture_grads",
    "capture_rng",
    "capture_state",
    "export_safetensors",
    "restore_grads",
    "restore_rng",
    "restore_state",
    "unwrap_model",
    "unwrap_state_dict",
]

_DATA_PARALLEL = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
STATE_KEYS = (
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "sampler",
    "rng",
    "epoch",
    "step",
    "world_size",
)
"""The keys `capture_state` always writes. Any other key of a captured state is the user's,
except `ACCUMULATION_KEYS`."""
ACCUMULATION_KEYS = ("micro_step", "grads")
"""The keys `capture_state` adds only for a state captured in the middle of gradient
accumulation (``micro_step`` > 0): a state saved at a step boundary is the same as before."""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``), in any order.

    Both wrappers put their own name in front of every state-dict key (``module.``,
    ``_orig_mod.``), so the bare model is where a state dict that must load into either form
    is read and loaded. A ``torch.compile``'d module is unwrapped by its ``_orig_mod`` child
    (``torch._dynamo.eval_frame.OptimizedModule`` registers it under that name); a top-level
    ``module`` attribute (DDP, DataParallel, `refimpl.ddp.MiniDDP`) by that. Example:
    ``unwrap_model(torch.compile(DDP(net))) is net``.
    """
    inner = model
    outermost = True
    while True:
        orig = inner._modules.get("_orig_mod")
        if isinstance(orig, torch.nn.Module):
            inner = orig
        elif isinstance(inner, _DATA_PARALLEL) or outermost:
            wrapped = getattr(inner, "module", None)
            if not isinstance(wrapped, torch.nn.Module):
                return inner
            inner, outermost = wrapped, False
        else:
            return inner


def _strip_prefixes(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with leading ``module.`` and ``_orig_mod.`` removed from every key."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def unwrap_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with DDP's ``module.`` (and compile's ``_orig_mod.``) removed.

    Example: ``unwrap_state_dict(DDP(net))`` and ``unwrap_state_dict(torch.compile(net))``
    have the keys of ``net.state_dict()``.
    """
    return _strip_prefixes(unwrap_model(model).state_dict())


def capture_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the gradients accumulated in ``model`` so far, by unwrapped name.

    What a checkpoint taken in the middle of gradient accumulation must hold: the
    micro-batches already backpropagated live only in ``.grad`` (under DDP's ``no_sync`` each
    rank's own, not yet averaged). Parameters without a gradient are left out.
    """
    return {
        name: p.grad.detach().to("cpu", copy=True)
        for name, p in _strip_prefixes(dict(unwrap_model(model).named_parameters())).items()
        if p.grad is not None
    }


def restore_grads(model: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Put back what `capture_grads` captured; every other gradient is set to None.

    Each gradient is copied onto its parameter's device and dtype. Raises KeyError naming the
    saved names this model does not have.
    """
    params = _strip_prefixes(dict(unwrap_model(model).named_parameters()))
    unknown = sorted(set(grads) - set(params))
    if unknown:
        raise KeyError(f"saved gradients for parameters this model does not have: {unknown}")
    for name, p in params.items():
        g = grads.get(name)
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype, copy=True)


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
    """Put back what `capture_rng` captured (after a weights-only load).

    The state may have been loaded onto a GPU (``map_location=rank_device()`` moves every
    tensor of a checkpoint there); RNG states are host data, so each is read from the CPU.
    """
    py = state["python"]
    if isinstance(py, Mapping):
        random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss"]))
    else:  # refimpl 0.1.0 checkpoints stored getstate()'s tuple as is
        version, internal, gauss = py
        random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _user_keys(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``extra`` as a dict, after checking that no key would clash or fail to save."""
    for key in extra:
        if not isinstance(key, str) or not KEY_RE.fullmatch(key):
            raise ValueError(
                f"extra key {key!r}: use a str of letters, digits, '_', '.' and '-' (not "
                "starting with '.' or '-'), the names save_checkpoint accepts as keys"
            )
        if key in STATE_KEYS + ACCUMULATION_KEYS:
            raise ValueError(
                f"extra key {key!r} is one capture_state writes itself "
                f"({', '.join(STATE_KEYS + ACCUMULATION_KEYS)}): pick another name"
            )
    return dict(extra)


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
    micro_step: int = 0,
    grads: Any = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything an exact resume needs, as one weights-only-loadable dict.

    The dict has the keys of `STATE_KEYS`: the weights (``module.`` removed), the optimizer's,
    scheduler's and scaler's state dicts (None when not given), the sampler state, the RNG
    states, ``epoch``, ``step`` and ``world_size``. ``rng`` is what `capture_rng` returned, or
    a list of them, one per rank in rank order (`refimpl.trainstate.capture_every_rank`
    gathers it), or None for this process's.

    ``micro_step``: with gradient accumulation, how many micro-batches of the next optimizer
    step are already accumulated into ``.grad`` (0, the default: captured at a step boundary,
    no key added). Above 0 the state gets `ACCUMULATION_KEYS`: ``micro_step`` and the gradients
    (``grads``: `capture_grads` of this process, or a list of them in rank order, as for
    ``rng``), and ``sampler_state`` must
    be the position of the next *micro*-batch; a resume then runs the remaining micro-batches
    and steps as the uninterrupted run did. Saving only at step boundaries keeps checkpoints
    free of gradients and restorable at any world size.

    ``extra`` adds your own keys (a best loss, the model's arguments, the run's config) to the
    same dict; `restore_state` returns them under ``"extra"``. A key may not be one of
    `STATE_KEYS` and must be a file-name-safe str (``save_checkpoint`` writes every top-level
    key as its own file), and each value must be something ``torch.load(weights_only=True)``
    rebuilds: tensors, numbers, str, and lists, tuples and dicts of them (``save_checkpoint``
    checks this before writing). Setting a key on the returned dict works the same way, with
    no check. The weights and optimizer state are the live tensors, not copies: save the dict
    before the next ``optimizer.step()``. Example::

        state = capture_state(ddp_model, opt, scheduler=sched, scaler=scaler,
                              sampler_state=sampler.state_dict(batches_done=k),
                              epoch=0, step=k, world_size=2,
                              extra={"best_val_loss": 1.25, "config": {"lr": 3e-4}})
        save_checkpoint(ckpt_dir, state, step=k)
    """
    if micro_step < 0:
        raise ValueError(f"micro_step must be >= 0, got {micro_step}")
    user = _user_keys(extra) if extra is not None else {}
    state = {
        "model": unwrap_state_dict(model),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "sampler": dict(sampler_state) if sampler_state is not None else None,
        "rng": rng if rng is not None else capture_rng(),
        "epoch": int(epoch),
        "step": int(step),
        "world_size": int(world_size),
        **user,
    }
    if micro_step:
        state["micro_step"] = int(micro_step)
        state["grads"] = grads if grads is not None else capture_grads(model)
    return state


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
    """Load ``state`` into the given objects; return what the caller puts back itself.

    The returned dict has ``"epoch"``, ``"step"``, ``"world_size"`` (the saved one),
    ``"micro_step"`` (0 for a state saved at a step boundary, or by an older refimpl),
    ``"sampler"`` (the sampler state, for ``sampler.load_state_dict``), ``"extra"`` (every key
    of ``state`` that is not one of `STATE_KEYS`: what ``capture_state(extra=...)`` added) and
    ``"rng_restored"``. The model may be DDP-wrapped, compiled, or bare, and the saved keys
    may carry ``module.`` / ``_orig_mod.`` (both are removed: `unwrap_model`).

    Gradients saved in the middle of accumulation (``micro_step`` > 0) are restored into the
    model: a list of per-rank ones only at the world size it was saved at, rank ``rank``
    taking its own. At another world size it raises ValueError before loading anything:
    un-averaged gradients of N ranks cannot be split among M, so resume from a step saved at
    a step boundary.

    RNG: a list of per-rank states (one per saved rank) is restored only at the world size
    it was saved at, rank ``rank`` taking its own; at another world size (or with ``rank``
    outside the list) no RNG is restored and every rank keeps the stream it seeded itself,
    since no rule maps N ranks' streams onto M ranks' draws. A single state is restored as
    is. ``world_size=None`` skips the world-size check. Load the file on every rank with
    ``safe_load(path, map_location=rank_device())``. Example::

        info = restore_state(safe_load(path), ddp_model, opt, scheduler=sched, rank=rank,
                             world_size=2)
        sampler.load_state_dict(info["sampler"])
        best_val_loss = info["extra"].get("best_val_loss", float("inf"))
    """
    grads = state.get("grads")
    if isinstance(grads, list) and not (
        world_size in (None, len(grads)) and 0 <= rank < len(grads)
    ):
        raise ValueError(
            f"rank {rank}: this state was saved in the middle of gradient accumulation "
            f"(micro-step {state.get('micro_step')}) by {len(grads)} ranks, and this run has "
            f"world size {world_size}; those gradients cannot be split among other ranks. "
            "Resume from a step saved at an optimizer-step boundary (micro_step=0)."
        )
    unwrap_model(model).load_state_dict(_strip_prefixes(state["model"]))
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    rng, restored = state.get("rng"), False
    if isinstance(rng, list):
        if world_size in (None, len(rng)) and 0 <= rank < len(rng):
            restore_rng(rng[rank])
            restored = True
    elif rng is not None:
        restore_rng(rng)
        restored = True
    if isinstance(grads, list):
        restore_grads(model, grads[rank])
    elif grads is not None:
        restore_grads(model, grads)
    return {
        "epoch": int(state["epoch"]),
        "step": int(state["step"]),
        "world_size": int(state["world_size"]),
        "micro_step": int(state.get("micro_step", 0)),
        "sampler": state.get("sampler"),
        "extra": {k: v for k, v in state.items() if k not in STATE_KEYS + ACCUMULATION_KEYS},
        "rng_restored": restored,
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

    tensors = {k: inference_tensor(v, dtype) for k, v in unwrap_state_dict(model).items()}
    return atomic_write_bytes(save(tensors), path)
