"""Chapter 5: checkpoints that are complete, verified and never unpickle code.

Layout: one directory per step, published atomically by `refimpl.atomic.atomic_dir`::

    ckpt/step_00000200/
        model.pt  optim.pt  ...   one file per top-level key of the saved state
        MANIFEST.json             step, and the sha256 and size of every file (written last)
        COMMITTED                 atomic_dir's marker (written after the manifest)

`load_latest` walks the steps newest first and returns the first one that verifies (marker,
manifest, every file's size and sha256) *before* anything is deserialised; each step it
skips is reported with the reason. `safe_load` only ever uses ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from refimpl.atomic import COMMIT_MARKER, TEMP_TAG, atomic_dir, atomic_write, remove_stale_temps

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "safe_load",
    "save_checkpoint",
    "step_dir_name",
    "verify_checkpoint",
]

MANIFEST = "MANIFEST.json"
"""Name of the manifest file inside every step directory."""
_STEP_RE = re.compile(r"step_(\d{8,})")
_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_CHUNK = 1 << 20
logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved, verified or loaded. ``path`` names the file or step."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = Path(path)
        self.reason = message


def step_dir_name(step: int) -> str:
    """The directory name of ``step``: zero-padded so names sort like numbers."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every ``step_N`` directory in ``ckpt_dir`` (committed or not), oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_RE.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_checkpoint(step_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a step directory without deserialising it; return its manifest.

    Raises `CheckpointError` naming the first problem: no commit marker (the save never
    finished), a missing or unreadable manifest, a missing file, a size that differs from
    the manifest (truncated), or a sha256 that differs (a flipped bit, a partial overwrite).
    """
    step_dir = Path(step_dir)
    if not (step_dir / COMMIT_MARKER).is_file():
        raise CheckpointError(step_dir, f"incomplete: no {COMMIT_MARKER} marker (save unfinished)")
    try:
        manifest: dict[str, Any] = json.loads((step_dir / MANIFEST).read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
        expected = {name: (int(m["bytes"]), str(m["sha256"])) for name, m in files.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            step_dir / MANIFEST, f"manifest missing or unreadable ({exc})"
        ) from exc
    for name, (nbytes, sha256) in sorted(expected.items()):
        path = step_dir / name
        if not path.is_file():
            raise CheckpointError(path, "missing (listed in the manifest)")
        size = path.stat().st_size
        if size != nbytes:
            raise CheckpointError(path, f"size {size} bytes, manifest says {nbytes}")
        if _sha256_file(path) != sha256:
            raise CheckpointError(path, "sha256 mismatch with the manifest (corrupted bytes)")
    return manifest


def safe_load(path: str | os.PathLike[str]) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU, and nothing less safe, ever.

    The weights-only unpickler only rebuilds tensors, containers and primitive types, so a
    file whose pickle would call arbitrary code (a ``__reduce__`` returning ``os.system``)
    is refused with `CheckpointError` before any of its code runs. There is deliberately
    no retry with ``weights_only=False``: that retry is exactly what an attacker wants.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            path,
            f"refused: not a weights-only file ({first}). It asks to rebuild Python objects "
            "that could run code. Do not retry with weights_only=False on a file you did "
            "not write; if you trust its source, allowlist the type with "
            "torch.serialization.add_safe_globals([...]).",
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(path, f"cannot be read ({exc}); truncated or corrupt?") from exc


def load_checkpoint(step_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Verify ``step_dir`` (see `verify_checkpoint`), then `safe_load` every file in it."""
    manifest = verify_checkpoint(step_dir)
    return {name[: -len(".pt")]: safe_load(Path(step_dir) / name) for name in manifest["files"]}


def _log_skip(step_dir: Path, reason: str) -> None:
    logger.warning("load_latest: skipped %s (%s); trying an older step", step_dir.name, reason)


def load_latest(
    ckpt_dir: str | os.PathLike[str],
    *,
    on_skip: Callable[[Path, str], None] | None = None,
) -> tuple[int, dict[str, Any]] | None:
    """The newest checkpoint in ``ckpt_dir`` that verifies, as ``(step, state)``; else None.

    Steps are tried newest first. A step that is incomplete, corrupt or unloadable is
    skipped and reported through ``on_skip(step_dir, reason)`` (by default a logged warning
    naming the step and the reason), and the next older one is tried. Nothing is
    deserialised before its bytes match the manifest.

    Example::

        found = load_latest("ckpt", on_skip=lambda d, why: print("skipped", d.name, why))
        start = 0 if found is None else found[0] + 1
    """
    report = on_skip or _log_skip
    for step, step_dir in reversed(list_checkpoints(ckpt_dir)):
        try:
            return step, load_checkpoint(step_dir)
        except CheckpointError as exc:
            report(step_dir, exc.reason if exc.path == step_dir else str(exc))
    return None


def _saver(obj: Any) -> Callable[[IO[bytes]], None]:
    return lambda f: torch.save(obj, f)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{TEMP_TAG}{os.getpid()}-{secrets.token_hex(4)}")


def _remove_dir(path: Path) -> None:
    """Rename to a temp name first, so a kill mid-delete never leaves a half step_N."""
    doomed = _temp_name(path)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _prune(ckpt_dir: Path, keep_last: int, saved_step: int) -> None:
    """Keep ``keep_last`` committed steps up to ``saved_step``; never touch newer ones.

    The step just saved is verified by construction and counts as one of them; anything
    newer was written by an earlier run and is left for the user to judge.
    """
    older = [(s, d) for s, d in list_checkpoints(ckpt_dir) if s < saved_step]
    committed = [d for _, d in older if (d / COMMIT_MARKER).is_file()]
    doomed = [d for _, d in older if not (d / COMMIT_MARKER).is_file()]
    doomed += committed[: max(0, len(committed) - (keep_last - 1))]
    for d in doomed:
        _remove_dir(d)


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    state: Mapping[str, Any],
    step: int,
    keep_last: int | None = 3,
    *,
    durable: bool = True,
) -> Path:
    """Save ``state`` as ``ckpt_dir/step_N`` atomically, with a sha256 manifest; return it.

    Each top-level key becomes ``KEY.pt`` (sha256 computed while writing), then
    ``MANIFEST.json`` and the commit marker, all inside a temporary directory that is
    fsynced and renamed into place (`refimpl.atomic.atomic_dir`). Temporaries left by a
    killed earlier save are removed first; afterwards only the ``keep_last`` newest
    committed steps up to this one are kept. On failure (ENOSPC, EIO) a `CheckpointError`
    names the step and the cause; earlier checkpoints and the previous copy of this step,
    if any, are left intact. Call it on one rank only (see chapter 4).

    Example::

        save_checkpoint("ckpt", {"model": model.state_dict(), "optim": opt.state_dict()}, 200)
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    bad = [k for k in state if not (isinstance(k, str) and _KEY_RE.fullmatch(k))]
    if bad or not state:
        raise ValueError(f"state must be a non-empty dict with file-name-safe str keys; bad: {bad}")
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(root)
    final = root / step_dir_name(step)
    aside = None
    if final.exists():  # re-saving a step (a resumed run): keep the old copy until done
        aside = _temp_name(final)
        os.rename(final, aside)
    try:
        with atomic_dir(final, durable=durable) as tmp:
            files = {}
            for key, value in state.items():
                name = f"{key}.pt"
                digest = atomic_write(tmp / name, _saver(value), durable=False, sha256=True)
                files[name] = {"sha256": digest, "bytes": (tmp / name).stat().st_size}
            manifest = {"format": 1, "step": step, "files": files}
            atomic_write(
                tmp / MANIFEST, lambda f: f.write(json.dumps(manifest).encode()), durable=False
            )
    except OSError as exc:
        if aside is not None:
            with contextlib.suppress(OSError):
                os.rename(aside, final)
        raise CheckpointError(
            final,
            f"save of step {step} failed: {exc}. Earlier checkpoints are intact and the "
            "temporary files were removed; fix the cause (free space? disk errors?) and retry.",
        ) from exc
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    if keep_last is not None:
        _prune(root, keep_last, step)
    return final
