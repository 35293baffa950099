"""Chapters 8-9: sharded checkpoints with DCP that commit atomically and load at any size.

``torch.distributed.checkpoint`` (DCP) has every rank write its own shards in parallel and
reshards on load, but its ``FileSystemWriter`` writes straight into the directory it is
given: a save that dies half-way leaves new shards beside an old ``.metadata`` (which then
loads silently wrong), a failure surfaces as ``CheckpointException``, a ``BaseException``
that ``except Exception`` misses, and ``dcp.load`` unpickles ``.metadata`` with plain
``pickle.load``. Here DCP keeps doing the writing and the resharding; refimpl adds:

- a fresh hidden temporary directory for every save, committed by rank 0 once every rank's
  files are durable: ``MANIFEST.json`` (size and xxh3-128 digest of each file), the
  ``COMMITTED`` marker, fsync, rename to ``step_N``, fsync of the parent
  (`refimpl.sharded._group` has the protocol);
- a loader that verifies the manifest and unpickles ``.metadata`` through an allowlist
  *before* DCP opens anything, falls back past incomplete, corrupt or hostile steps saying
  why, loads non-tensor items weights-only, and reads of each saved chunk only the rows a
  rank holds (DCP reads whole chunks, which makes a resharded load slow);
- errors that are `refimpl.checkpoint.CheckpointError`\\ s naming the ranks, the step and
  what to do next.

The top-level keys are ``"model"`` and ``"optim"`` exactly as ``get_state_dict`` produces
them, so a plain ``dcp.load`` reads the same directory; ``state=`` entries (a scheduler, the
sampler, per-rank RNG: `refimpl.sharded._state`) ride in the same commit as bytes items under
``"state"`` and ``"state_rank<r>"``. A wrong path is an error, not a fresh start
(`refimpl.sharded._paths`). Every function is called on every
rank of the group (or without a process group, as a world of one).

Hold `refimpl.dirlock.DirLock` on the checkpoint directory for the run (every rank enters it;
rank 0 locks) around `load_sharded` and every save, `AsyncSaver`'s included: a second job
started in the same directory is then refused at start instead of overwriting this one's steps.
"""

from __future__ import annotations

from refimpl.sharded._api import (
    async_save_sharded,
    consolidate,
    load_sharded,
    save_sharded,
    verify_sharded,
)
from refimpl.sharded._async import AsyncSaver
from refimpl.sharded._async_handle import AsyncSaveHandle
from refimpl.sharded._errors import ShardedCheckpointError
from refimpl.sharded._export import export_hf
from refimpl.sharded._inspect import inspect_sharded
from refimpl.sharded._state import PerRank

__all__ = [
    "AsyncSaveHandle",
    "AsyncSaver",
    "PerRank",
    "ShardedCheckpointError",
    "async_save_sharded",
    "consolidate",
    "export_hf",
    "inspect_sharded",
    "load_sharded",
    "save_sharded",
    "verify_sharded",
]
