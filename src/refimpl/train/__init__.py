"""Chapter 10: a trainer that can be killed at any moment and finishes as if it never was.

Run it alone (a world of one) or as N processes that torchrun restarts when one dies::

    python -m refimpl.train --steps 20 --save-every 5 --ckpt-dir ckpt --final-weights w.pt
    torchrun --standalone --nproc_per_node=2 --max-restarts=2 -m refimpl.train \\
        --steps 20 --save-every 5 --ckpt-dir ckpt --final-weights w.pt --fail-at-step 8

The restart loop is torchrun's: when a worker exits non-zero, its agent SIGTERMs the others
(SIGKILL 30 s later), and starts all N again, using up one of ``--max-restarts``. So start-up
*is* recovery: every start calls `load_latest` and continues from the newest checkpoint that
verifies, restoring what an exact resume needs (weights, optimizer, sampler position, every
rank's RNG, the step). Running the same command again is always safe: a finished run finds its
last step and only rewrites the final weights. A start that finds committed steps but can load
none of them (all damaged, or written by the other backend: ``--sharded`` forgotten or added)
stops with the reasons instead of training from step 0 over them.

One run per ``--ckpt-dir``: rank 0 holds `refimpl.dirlock.DirLock` on it from start to exit,
so a second job started there (submitted twice, an old directory reused) stops at once,
naming the holder's host and pid, and a directory that cannot be written is refused before
the first step. A torchrun restart is the same job: its new rank 0 waits for the old one.

A start whose ``--lr``, ``--steps``, ``--samples`` or ``--seed`` contradicts the step it
resumes stops before training, naming the flag to pass (``--reset-lr`` applies a new rate
instead and says so: `refimpl/train/_flags.py`). A step that verifies but does not fit (an RNG
state of another size, a scheduler with other param groups) is skipped like a damaged one,
the reason logged (`refimpl/train/_restorable.py`).

``--sharded`` swaps DDP for FSDP2 and rank 0's file for chapter 8's DCP checkpoints, which
every rank writes in parallel and a restart at another world size reshards; the step, the
sampler's position and the LR schedule travel in the checkpoint's ``state=``, and dropout is
re-seeded from (seed, rank, step) instead of saved (`refimpl.train._sharded`). Add
``--async-save`` and each save is written while the next steps train, one at a time; the
trainer waits for it before the final weights and before a SIGTERM exit
(`refimpl.train._async`). Without ``--sharded``, ``--async-save`` does the same for rank 0's
file checkpoint (`refimpl.train._files.AsyncFileSaves`).

``--lr-schedule cosine --warmup-steps N`` warms the rate up linearly over N steps, then decays
it along a cosine to 0.1 x ``--lr`` at ``--steps`` (the default is a constant rate); the
scheduler's state is saved with every checkpoint on both backends (`refimpl.train._schedule`).

SIGTERM (a preemption: SLURM's ``--signal``, Kubernetes before its SIGKILL) finishes the current
step, saves it and exits 0 (`refimpl.preemption.StopOnSigterm`). The stop flag rides on the
per-step loss all-reduce, so a signal to any one rank stops every rank after the same step.

Restarts and torchrun's shared store: torch 2.13's torchrun keeps one TCPStore for every
attempt, where a restarted worker's ``init_process_group`` can read a dead worker's address and
fail ("Connection refused") or hang (pytorch/pytorch#135712). `refimpl.launch.init_from_env`
scopes the group's keys to the attempt, so this trainer needs no setting; a trainer that calls
``init_process_group`` itself can run torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refimpl.train._args import parse_args
    from refimpl.train._loop import main, make_data, make_model

__all__ = ["FAULT_MARKER", "main", "make_data", "make_model", "parse_args"]

FAULT_MARKER = "fault_injected_at_step_{step}"
"""Name of the file `--fail-at-step` leaves in the checkpoint directory: the crash fires once."""

# No torch here: ``python -m refimpl.train`` imports this package before ``__main__.py``, which
# pauses the cyclic collector before torch is imported (`refimpl._startup_gc`). The functions
# are imported on first use instead (PEP 562's module ``__getattr__``).
_HOMES = {"main": "_loop", "make_data": "_loop", "make_model": "_loop", "parse_args": "_args"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    value.__module__ = __name__  # documented, pickled and shown in tracebacks as refimpl.train.NAME
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
