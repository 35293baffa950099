"""Why `refimpl.train` must not start at step 0 when its ``--ckpt-dir`` holds committed steps.

A start that loads nothing trains from step 0 and saves over ``step_N`` as it goes, so
"nothing loaded" may only mean "nothing was there". When committed steps exist and none
loads (each was damaged, or all were written by the other backend: ``--sharded`` forgotten,
or added), the trainer stops and says why, naming the flag to pass when that is the cause.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

from refimpl._manifest import MAX_MANIFEST_BYTES
from refimpl.atomic import COMMIT_MARKER
from refimpl.checkpoint import MANIFEST, list_checkpoints

__all__ = ["refuse_fresh_start"]


def _backend_of(step_dir: Path) -> str | None:
    """``"sharded"``, ``"file"``, or None (unreadable): which trainer backend wrote the step.

    File checkpoints' manifests have an integer ``format``, sharded ones ``"refimpl.sharded/N"``.
    Read with a cap and without blocking: the manifest is untrusted (it may be a FIFO).
    """
    path = step_dir / MANIFEST
    with contextlib.suppress(OSError, ValueError):
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            manifest = json.loads(f.read(MAX_MANIFEST_BYTES + 1)[:MAX_MANIFEST_BYTES])
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        if isinstance(fmt, str) and fmt.startswith("refimpl.sharded/"):
            return "sharded"
        if type(fmt) is int:
            return "file"
    return None


def refuse_fresh_start(ckpt_dir: str, sharded: bool, skipped: list[str]) -> str | None:
    """What to say instead of starting at step 0 over committed steps in ``ckpt_dir``, or None.

    Call it when the load found nothing; ``skipped`` holds ``"step_N: reason"`` for each step
    the load skipped. Committed means: the step directory has its commit marker.
    """
    committed = [d for _, d in list_checkpoints(ckpt_dir) if (d / COMMIT_MARKER).is_file()]
    if not committed:
        return None
    other = "file" if sharded else "sharded"
    theirs = [d.name for d in committed if _backend_of(d) == other]
    if theirs:
        written = "without" if sharded else "with"
        return (
            f"{ckpt_dir} holds {len(theirs)} committed step(s) written {written} --sharded "
            f"({', '.join(theirs)}), which this run (started {'with' if sharded else 'without'}"
            f" --sharded) cannot load. Starting at step 0 would overwrite them: run again "
            f"{written} --sharded to resume them, or pass another --ckpt-dir for a new run."
        )
    reasons = "; ".join(skipped) or "(no reason reported)"
    return (
        f"{ckpt_dir} holds committed steps ({', '.join(d.name for d in committed)}) but none of "
        f"them loads: {reasons}. Starting at step 0 would overwrite them: fix what the reasons "
        "say, or move the steps away (or pass another --ckpt-dir) to start a new run."
    )
