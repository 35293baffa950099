"""Chapter 5: checkpoints that are complete, verified and never unpickle code.

Layout: one directory per step, built under a temporary name, fsynced and renamed into place
(`refimpl._publish`)::

    ckpt/step_00000200/
        state.pack                every top-level key, one torch.save archive each, back to back
        MANIFEST.json             format, step, versions, the size and digest of every file,
                                  and where in state.pack each key's archive is
        COMMITTED                 the commit marker (written after the manifest)

Steps written before format 3 hold one ``KEY.pt`` per key instead; they load the same way.

`load_latest` walks the steps newest first and returns the first one that verifies (marker,
manifest, every file's size and digest) *before* anything is deserialised; each step it
skips is reported with the reason. `safe_load` only ever uses ``weights_only=True``.

What it promises, and the tests attack: a save never destroys the committed copy of a step,
even when it re-saves that step and dies half-way; a state that could never be loaded is
refused before anything is written or pruned; a damaged newest step (EIO, a hostile manifest,
a crafted file) makes `load_latest` fall back, never crash; and nothing is deleted that this
code did not write or whose writer may still be alive.

One run per directory: two jobs saving into one ``ckpt_dir`` re-save over and prune each
other's steps. Hold `refimpl.dirlock.DirLock` on it for the run (``with DirLock(ckpt_dir):``
around the load and every save); a second writer is then refused at its start.
"""

from __future__ import annotations

from refimpl._step_dirs import MANIFEST, CheckpointError, list_checkpoints, step_dir_name
from refimpl.checkpoint._async import AsyncCheckpointer
from refimpl.checkpoint._files import (
    PACK,
    load_checkpoint,
    load_latest,
    safe_load,
    save_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "MANIFEST",
    "PACK",
    "AsyncCheckpointer",
    "CheckpointError",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "safe_load",
    "save_checkpoint",
    "step_dir_name",
    "verify_checkpoint",
]

# documented, shown in tracebacks and pickled by reference as refimpl.checkpoint's, as before
# the package (`refimpl._step_dirs` does the same for CheckpointError, which it defines)
AsyncCheckpointer.__module__ = __name__
