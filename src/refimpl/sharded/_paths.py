"""Which step `refimpl.sharded.load_sharded` loads, and why a wrong path is an error.

A training script that loads from a mistyped path and gets "nothing there" restarts from
scratch and overwrites its own history. So rank 0 tells apart:

- a checkpoint root that exists and holds no step yet: a fresh start, None;
- a root whose committed steps all fail to verify: an error naming each (not a fresh start);
- a path that does not exist, a file, a folder whose *subfolder* holds the steps, a folder of
  `refimpl.checkpoint` file steps: an error naming what was found and what to pass;
- one ``step_N`` directory: that step, loaded or refused, never another.

Nothing here talks to other ranks: `refimpl.sharded` broadcasts rank 0's `Choice`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refimpl._regular_file import is_regular
from refimpl._step_dirs import MANIFEST, STEP_RE, CheckpointError, list_checkpoints
from refimpl.atomic import COMMIT_MARKER
from refimpl.sharded._commit import Expected, verify_step
from refimpl.sharded._seen import Seen


@dataclass(frozen=True)
class Choice:
    """What rank 0 tells every rank to load; `refimpl.sharded` broadcasts it.

    ``step`` and ``step_dir`` are None when there is nothing to load: a fresh start, or,
    with ``fatal`` set, an error every rank raises.
    """

    step: int | None = None
    step_dir: str | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(step directory, why) for each newer step that did not verify."""
    fatal: str | None = None
    """The error every rank raises instead of loading, or None."""
    single: bool = False
    """Whether ``path`` named one step (it is loaded or refused, never another)."""
    expected: Expected = field(default_factory=dict)
    """The verified manifest's {file: (bytes, digest)}."""
    saved_world: int = 0
    """The world size that saved the step (0 when unknown)."""
    seen: dict[str, Seen] = field(default_factory=dict)
    """{data file: what rank 0 saw of it while hashing it} (`refimpl.sharded._seen`)."""


_FILE_KIND = "not a sharded step"  # how verify_step words a refimpl.checkpoint manifest


def _expected(manifest: dict[str, Any]) -> Expected:
    return {name: (e["bytes"], e["xxh3_128"]) for name, e in manifest["files"].items()}


def _fatal(message: str, single: bool = False) -> Choice:
    return Choice(fatal=message, single=single)


def _world(manifest: dict[str, Any]) -> int:
    world = manifest.get("world_size")
    return world if type(world) is int and world > 0 else 0


def _empty_root(path: Path) -> str | None:
    """Why ``path`` (no step_N directories in it) is not a fresh checkpoint root, or None."""
    if not path.exists():
        return (
            "does not exist. Pass the checkpoint directory your saves write to; a new "
            "run's is an existing, empty directory (create it first), which loads as a fresh start"
        )
    if not path.is_dir():
        return "is a file, not a directory; pass the checkpoint directory (its parent?)"
    nested = sorted({p.parent for p in path.glob("*/step_*") if STEP_RE.fullmatch(p.name)})
    if nested:
        return f"holds no step_N directories, but {nested[0]} does: pass that one"
    return None


def choose_step(path: Path, below: int | None = None) -> Choice:
    """Rank 0: the newest step of ``path`` (older than ``below``) that verifies."""
    if STEP_RE.fullmatch(path.name) or (path / MANIFEST).exists():
        seen: dict[str, Seen] = {}
        try:
            manifest = verify_step(path, seen)
        except CheckpointError as exc:  # the error names the step: say it once
            reason = exc.reason if exc.path == path else str(exc)
            return _fatal(f"{reason}. Pass the checkpoint directory to fall back", single=True)
        return Choice(
            step=int(manifest["step"]),
            step_dir=str(path),
            single=True,
            expected=_expected(manifest),
            saved_world=_world(manifest),
            seen=seen,
        )
    steps = list_checkpoints(path)
    if not steps:
        why = _empty_root(path)
        return _fatal(why) if why else Choice()
    skipped: list[tuple[str, str]] = []
    committed_bad = below is not None  # the step refused at load time was committed
    file_kind = 0
    for step, step_dir in reversed(steps):
        if below is not None and step >= below:
            continue
        seen = {}
        try:
            manifest = verify_step(step_dir, seen)  # each error inside is a CheckpointError: skip
            return Choice(
                step=step,
                step_dir=str(step_dir),
                skipped=skipped,
                expected=_expected(manifest),
                saved_world=_world(manifest),
                seen=seen,
            )
        except CheckpointError as exc:
            reason = exc.reason if exc.path == step_dir else str(exc)
            skipped.append((str(step_dir), reason))
            committed = is_regular(step_dir / COMMIT_MARKER)
            committed_bad = committed_bad or committed
            file_kind += committed and _FILE_KIND in reason
    if file_kind and file_kind == len(skipped) and below is None:
        return _fatal(
            f"holds refimpl.checkpoint file steps ({file_kind}), not sharded ones: load "
            "them with refimpl.checkpoint.load_latest, or pass the directory save_sharded writes"
        )
    if committed_bad:
        return Choice(
            skipped=skipped,
            fatal="no committed step can be loaded (each one is reported with its reason); "
            "restore a good copy or move the bad steps aside: starting over would discard them",
        )
    return Choice(skipped=skipped)
