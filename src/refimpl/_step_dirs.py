"""The step directories both checkpoint formats share: their names, the manifest and digest
they carry, listing them, pruning old ones, and the error and log line for one that fails.

A checkpoint root holds one ``step_N`` directory per saved step (N zero-padded to at least 8
ASCII digits), each with a ``MANIFEST.json`` that lists its files with their ``xxh3_128``
digests and a commit marker. `refimpl.checkpoint` (one file per step) and `refimpl.sharded`
(one shard per rank) fill the directories differently; what a directory is named, how it is
found and when it is deleted is the same for both, and lives here.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from refimpl._publish import restore_asides, temp_path
from refimpl.atomic import COMMIT_MARKER

__all__ = [
    "DIGEST",
    "MANIFEST",
    "STEP_RE",
    "CheckpointError",
    "list_checkpoints",
    "log_skip",
    "prune",
    "step_dir_name",
]

MANIFEST = "MANIFEST.json"
"""Name of the manifest file inside every step directory."""

STEP_RE = re.compile(r"step_([0-9]{8,})", re.ASCII)  # ASCII digits only: "step_٠٠..." is not ours
"""A step directory's name, its step number in group 1 (match it with ``fullmatch``)."""

DIGEST = "xxh3_128"
"""The digest written for every file. Its job is to catch accidental damage (a torn write, a
flipped bit, a truncated copy): a 128-bit hash misses a random corruption with probability
2**-128, and xxh3 runs at memory speed, so verifying costs little next to the write. It is not
a defence against someone who can rewrite the directory (they would rewrite the manifest
too); weights-only loading (`refimpl.checkpoint.safe_load`) is that defence."""

logger = logging.getLogger("refimpl.checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved, verified or loaded. ``path`` names the file or step."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = Path(path)
        self.reason = message


# Documented, shown in tracebacks and pickled by reference as refimpl.checkpoint's (a
# CheckpointError raised in a rank reaches the parent through pickle).
CheckpointError.__module__ = "refimpl.checkpoint"


def step_dir_name(step: int) -> str:
    """The directory name of ``step``: zero-padded so names sort like numbers."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every ``step_N`` directory in ``ckpt_dir`` (committed or not), oldest first.

    A step that a save killed mid-publish left under its aside name is renamed back first
    (`refimpl._publish.restore_asides`), so every load, prune and cleanup sees it."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    restore_asides(root, steps=STEP_RE)
    found = []
    for entry in root.iterdir():
        match = STEP_RE.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def prune(ckpt_dir: Path, keep_last: int, saved_step: int) -> None:
    """Keep ``keep_last`` committed steps up to ``saved_step``; never touch anything else.

    The step just saved is verified by construction and counts as one of them. Newer steps
    (written by an earlier run) and step directories without a commit marker (not written by
    this code: ours only ever appear complete) are left for the user to judge.
    """
    older = [(s, d) for s, d in list_checkpoints(ckpt_dir) if s < saved_step]
    committed = [d for _, d in older if (d / COMMIT_MARKER).is_file()]
    for d in committed[: max(0, len(committed) - (keep_last - 1))]:
        doomed = temp_path(d)  # rename first, so a kill mid-delete never leaves half a step
        os.rename(d, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def log_skip(step_dir: Path, reason: str) -> None:
    """Log (warning, logger ``refimpl.checkpoint``) that a load skipped ``step_dir`` and why."""
    logger.warning("load_latest: skipped %s (%s); trying an older step", step_dir.name, reason)
