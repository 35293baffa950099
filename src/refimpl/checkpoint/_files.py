"""File checkpoints: save, list, verify and load one directory per step, and prune old ones.

The package docstring (`refimpl.checkpoint`) gives the layout and what it promises.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from refimpl import __version__
from refimpl._manifest import (
    FORMAT,
    MAX_MANIFEST_BYTES,
    ManifestError,
    as_step,
    key_ranges,
    parse,
    refusal,
)
from refimpl._pack import PACK as _PACK
from refimpl._pack import KeyRange, KeyWindow, write_pack
from refimpl._publish import Stage, publish_dir, temp_dir
from refimpl._regular_file import read_regular
from refimpl._step_dirs import (
    DIGEST,
    MANIFEST,
    STEP_RE,
    CheckpointError,
    list_checkpoints,
    log_skip,
    prune,
    step_dir_name,
)
from refimpl._write_errors import oserror_advice, root_oserror
from refimpl.atomic import (
    COMMIT_MARKER,
    DIGESTS,
    atomic_write,
)

PACK = _PACK
"""Name of the one file that holds every top-level key of a step (``torch.save`` archives back
to back; the manifest's ``"keys"`` says where each is). Steps older than format 3 have one
``KEY.pt`` per key instead."""
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CHUNK = 1 << 20
logger = logging.getLogger(__name__)


def _digest_file(path: Path, algorithm: str) -> str:
    digest = DIGESTS[algorithm]()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return str(digest.hexdigest())


def _verify(step_dir: Path) -> dict[str, Any]:
    if not (step_dir / COMMIT_MARKER).is_file():
        raise CheckpointError(step_dir, f"incomplete: no {COMMIT_MARKER} marker (save unfinished)")
    manifest_path = step_dir / MANIFEST
    try:
        raw = read_regular(manifest_path, MAX_MANIFEST_BYTES)  # a FIFO there must not block
        present = {p.name for p in step_dir.iterdir()} - {MANIFEST, COMMIT_MARKER}
        expected = parse(manifest_path, raw, present)
    except OSError as exc:
        raise CheckpointError(manifest_path, f"manifest missing or unreadable ({exc})") from exc
    except ManifestError as exc:
        raise CheckpointError(manifest_path, f"manifest refused ({exc})") from exc
    for name, (nbytes, algorithm, digest) in sorted(expected.items()):
        path = step_dir / name
        if not path.is_file() or path.is_symlink():
            raise CheckpointError(path, "missing or not a regular file (listed in the manifest)")
        size = path.stat().st_size
        if size != nbytes:
            raise CheckpointError(path, f"size {size} bytes, manifest says {nbytes}")
        if _digest_file(path, algorithm) != digest:
            raise CheckpointError(path, f"{algorithm} mismatch with the manifest (corrupted bytes)")
    manifest: dict[str, Any] = json.loads(raw)
    named = STEP_RE.fullmatch(step_dir.name)
    step = manifest.get("step")
    if named and (type(step) is not int or step != int(named.group(1))):
        # A copied or renamed step verifies file by file; loading it would resume the wrong step.
        raise CheckpointError(
            manifest_path,
            f"says step {step!r}, but its directory is {step_dir.name}: a copied or renamed "
            "step. Rename it to the step its manifest names if that is what it holds",
        )
    return manifest


def verify_checkpoint(step_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a step directory without deserialising it; return its manifest.

    Raises `CheckpointError` naming the first problem: no commit marker (the save never
    finished), a missing, malformed or unknown-format manifest, a file the manifest does not
    list (or lists but is missing), a size that differs (truncated), or a digest that differs
    (a flipped bit, a partial overwrite). Filesystem errors while reading (EIO, EUCLEAN from
    a damaged inode) are reported the same way, never raised raw.
    """
    step_dir = Path(step_dir)
    try:
        return _verify(step_dir)
    except CheckpointError:
        raise
    except (OSError, ValueError) as exc:
        raise CheckpointError(step_dir, f"cannot be read ({exc})") from exc


def _first_lines(text: str, limit: int = 12) -> str:
    lines = [ln.rstrip() for ln in _ANSI_RE.sub("", text).strip().splitlines() if ln.strip()]
    return "\n".join(lines[:limit]) + ("\n..." if len(lines) > limit else "")


def safe_load(path: str | os.PathLike[str], *, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``, and nothing less safe, ever.

    The weights-only unpickler only rebuilds tensors, containers and primitive types, so a
    file whose pickle would call arbitrary code (a ``__reduce__`` returning ``os.system``)
    is refused with `CheckpointError` before any of its code runs; the message keeps
    torch's explanation, including the type you would have to allowlist. There is
    deliberately no retry with ``weights_only=False``: that retry is exactly what an attacker
    wants. Any other failure to read the file (truncated, crafted, unreadable) is a
    `CheckpointError` too. ``map_location`` is passed to ``torch.load`` (default: the CPU).
    """
    return _weights_only(path, path, map_location)


def _weights_only(source: Any, path: str | os.PathLike[str], map_location: Any) -> Any:
    """`safe_load` of ``source`` (a path or a readable, seekable file); errors name ``path``."""
    import pickle

    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            path,
            "refused: not a weights-only file. It asks to rebuild Python objects that could "
            "run code. Do not retry with weights_only=False on a file you did not write; if "
            "you trust its source, allowlist the type for this load only with "
            "`with torch.serialization.safe_globals([...]):`. torch says:\n"
            + _first_lines(str(exc)),
        ) from exc
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as exc:  # crafted or damaged files raise IndexError, TypeError, ...
        raise CheckpointError(
            path, f"cannot be read ({type(exc).__name__}: {_first_lines(str(exc), 3)})"
        ) from exc


def load_checkpoint(
    step_dir: str | os.PathLike[str],
    *,
    keys: Iterable[str] | None = None,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """Verify ``step_dir`` (see `verify_checkpoint`), then `safe_load` its files.

    ``keys`` loads only those top-level keys (every file is still verified first, but only
    those keys are deserialised); ``map_location`` goes to ``torch.load``, e.g.
    ``{"cuda:0": f"cuda:{local_rank}"}``. Raises `CheckpointError` naming the step when it
    does not verify or lacks one of ``keys`` (the message lists the keys it has).
    """
    return _load_verified(step_dir, keys, map_location)[1]


class _MissingKeys(CheckpointError):
    """A step that verifies but lacks a key asked for: a wrong name, not a damaged step."""


def _load_verified(
    step_dir: str | os.PathLike[str], keys: Iterable[str] | None, map_location: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`load_checkpoint`, returning the manifest that was verified along with the state."""
    manifest = verify_checkpoint(step_dir)
    files = {name: (entry["bytes"], "", "") for name, entry in manifest["files"].items()}
    ranges = key_ranges(manifest, files)  # verified: parse checked this table already
    wanted = list(ranges) if keys is None else list(keys)
    unknown = [k for k in wanted if k not in ranges]
    if unknown:
        raise _MissingKeys(step_dir, f"no key(s) {unknown}; it has {sorted(ranges)}")
    state = {k: _load_key(Path(step_dir), k, ranges[k], map_location) for k in wanted}
    return manifest, state


def _load_key(step_dir: Path, key: str, where: KeyRange, map_location: Any) -> Any:
    """One key's value: its own file (formats 1-2) or its range of the pack (format 3)."""
    path = step_dir / where.file
    if where.length is None:
        return safe_load(path, map_location=map_location)
    try:
        with open(path, "rb") as f:
            window = KeyWindow(f, where.offset, where.length)
            return _weights_only(window, f"{path} (key {key!r})", map_location)
    except OSError as exc:
        raise CheckpointError(path, f"cannot be read ({exc})") from exc


def _explain_empty(root: Path) -> None:
    """Say what ``load_latest`` looked at when it found no step at all."""
    if not root.exists():
        logger.info("load_latest: %s does not exist: no checkpoint yet, starting fresh", root)
        return
    if not root.is_dir():
        raise CheckpointError(root, "is not a directory; pass the checkpoint directory")
    if STEP_RE.fullmatch(root.name) or (root / MANIFEST).exists():
        raise CheckpointError(
            root, f"is one step, not a checkpoint directory: pass its parent {root.parent}"
        )
    nested = sorted({p.parent for p in root.glob("*/step_*") if STEP_RE.fullmatch(p.name)})
    if nested:
        raise CheckpointError(
            root, f"holds no step_N directories, but {nested[0]} does: did you mean that one?"
        )
    logger.info("load_latest: no step_N directories in %s: starting fresh", root)


def load_latest(
    ckpt_dir: str | os.PathLike[str],
    *,
    on_skip: Callable[[Path, str], None] | None = None,
    map_location: Any = "cpu",
    on_load: Callable[[Path, dict[str, Any]], None] | None = None,
    below: int | None = None,
    keys: Iterable[str] | None = None,
) -> tuple[int, dict[str, Any]] | None:
    """The newest checkpoint in ``ckpt_dir`` that verifies, as ``(step, state)``; else None.

    Steps are tried newest first. A step that is incomplete, corrupt, unreadable (EIO) or
    unloadable is skipped and reported through ``on_skip(step_dir, reason)`` (by default a
    logged warning naming the step and the reason), and the next older one is tried: a
    restarted job falls back, it does not crash on every start. Nothing is deserialised
    before its bytes match the manifest. With no steps at all it returns None and logs what
    it looked at; pointing it at a step directory, or at the parent of the checkpoint
    directory, is a `CheckpointError` that says which directory to pass instead.
    ``on_load(step_dir, manifest)``, if given, is called with the step returned and the
    manifest its files were verified against (`refimpl.trainstate.check_same_checkpoint`
    compares its digest across ranks). ``below`` considers only the steps older than it: the
    way back past a step that verified but could not be restored (`refimpl.train` does this).

    ``keys`` deserialises only those top-level keys of the step it returns (its files are
    still all verified): read the model's configuration before building the model, then
    resume into it. A verified step without one of ``keys`` raises `CheckpointError` naming
    the keys it has, instead of falling back to an older step that has them. Example::

        found = load_latest("ckpt", keys=["config"])     # nothing else is unpickled
        model = GPT(**(found[1]["config"] if found else default_config))
        resumed = resume_every_rank("ckpt", model, optimizer)

    Example::

        found = load_latest("ckpt", on_skip=lambda d, why: print("skipped", d.name, why))
        start = 0 if found is None else found[0] + 1
    """
    report = on_skip or log_skip
    root = Path(ckpt_dir)
    steps = list_checkpoints(root)
    if not steps:
        _explain_empty(root)
        return None
    for step, step_dir in reversed(steps):
        if below is not None and step >= below:
            continue
        try:
            manifest, state = _load_verified(step_dir, keys, map_location)
        except _MissingKeys:
            raise
        except CheckpointError as exc:
            report(step_dir, exc.reason if exc.path == step_dir else str(exc))
        except OSError as exc:  # e.g. the directory vanished between listing and reading
            report(step_dir, f"cannot be read ({exc})")
        else:
            if on_load is not None:
                on_load(step_dir, manifest)
            return step, state
    return None


def _range_entry(where: KeyRange) -> dict[str, Any]:
    return {"file": where.file, "offset": where.offset, "bytes": where.length}


def _validate(state: Mapping[str, Any], final: Path) -> None:
    problem = refusal(state)
    if problem:
        raise CheckpointError(final, f"refused before writing anything: {problem}")


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    state: Mapping[str, Any],
    step: int,
    keep_last: int | None = 3,
    *,
    durable: bool = True,
) -> Path:
    """Save ``state`` as ``ckpt_dir/step_N`` atomically, with a verified manifest; return it.

    Everything is checked before anything is touched: ``step`` (an int, numpy int or 0-d
    integer tensor), ``keep_last``, the keys, and that every value is something
    ``torch.load(weights_only=True)`` rebuilds (a ``pathlib.Path`` or ``np.float64`` is
    refused with the key and the fix, since such a checkpoint could never be loaded). Each
    top-level key becomes one ``torch.save`` archive in ``state.pack`` (one file, so a save
    of many small keys costs one file's creation and fsync, not one per key), then
    ``MANIFEST.json`` (each key's range) and the commit marker, all in a temporary directory
    that is fsynced and then published as ``step_N``. Re-saving an
    existing step swaps the new copy in atomically, so a crash at any point leaves the old
    copy or the new one. Temporaries that dead writers on this machine left are removed;
    afterwards only the ``keep_last`` newest committed steps up to this one are kept. On
    failure (ENOSPC, EIO) a `CheckpointError` names the step and the cause. Call it on one
    rank only (see chapter 4).

    Example::

        save_checkpoint("ckpt", {"model": model.state_dict(), "optim": opt.state_dict()}, 200)
    """
    step = as_step(step)
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
    root = Path(ckpt_dir)
    final = root / step_dir_name(step)
    _validate(state, final)
    root.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    writing = "its temporary directory"  # what a failure names: never the temp's own name
    stages: dict[Stage, str] = {
        "fsync": "the step (fsync)",
        "publish": f"the step (publishing it as {final.name})",
        "fsync-parent": f"the step (syncing {root})",
    }

    def stage(now: Stage) -> None:
        nonlocal writing
        writing = stages[now]

    try:
        tmp = temp_dir(final, sweep="parent")
        ranges: dict[str, KeyRange] = {}

        def started(key: str) -> None:
            nonlocal writing
            writing = f"key {key!r} ({PACK})"

        def pack(f: IO[bytes]) -> None:
            ranges.update(write_pack(f, state, started))

        digest = atomic_write(tmp / PACK, pack, durable=False, digest=DIGEST)
        manifest = {
            "format": FORMAT,
            "step": step,
            "files": {PACK: {DIGEST: digest, "bytes": (tmp / PACK).stat().st_size}},
            "keys": {k: _range_entry(r) for k, r in ranges.items()},
            "torch": torch.__version__,
            "refimpl": __version__,
        }
        writing = MANIFEST
        atomic_write(
            tmp / MANIFEST, lambda f: f.write(json.dumps(manifest).encode()), durable=False
        )
        writing = COMMIT_MARKER
        (tmp / COMMIT_MARKER).touch()  # written last: its presence means "everything is here"
        publish_dir(tmp, final, replace=True, durable=durable, stage=stage)
    except OSError as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        err = root_oserror(exc, innermost=True) or exc
        raise CheckpointError(
            final,
            f"save of step {step} failed while writing {writing} ({err.strerror or err}). "
            f"{oserror_advice(err, final)}. Earlier checkpoints (and any earlier copy of this "
            "step) are intact and the temporary files were removed.",
        ) from exc
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        prune(root, keep_last, step)
    return final
