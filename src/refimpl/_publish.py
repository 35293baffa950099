"""Publishing under a temporary name: a crash leaves the old copy or the new one, never half.

Every writer of refimpl builds what it writes under a temporary name next to its target,
``.NAME.tmp-OWNER-PID-RANDOM`` (`temp_path`), and renames it into place when it is complete:
one file (`refimpl.atomic.atomic_write`) or a whole directory (`refimpl.atomic.atomic_dir`, a
file checkpoint's step, a sharded checkpoint's step, a Hugging Face export). This module is
the part they share: the temporary names and the sweep of the ones dead writers left
(`remove_stale_temps`), and, for a directory, `temp_dir` (make it) and `publish_dir` (fsync
it, rename it into place, fsync the parent), or `staged_dir` for the whole sequence.

A new directory is one rename. A re-saved step is swapped in with Linux's
``renameat2(RENAME_EXCHANGE)`` so that a committed copy exists at every instant, or, where the
kernel or filesystem cannot exchange, by moving the old copy aside only after the new one is
complete.

That fallback has a window: between "old copy aside" and "new copy in", no ``step_N``
exists. A writer killed there leaves the committed step under its aside name,
``.step_N.aside-OWNER-PID-RANDOM``: a tag of its own, which the stale-temp sweep never
matches, and which `restore_asides` (called by every listing of the steps, so before any
load, prune or cleanup) renames back.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from refimpl._system import disk, proc

__all__ = [
    "ASIDE_TAG",
    "OWNER",
    "TEMP_TAG",
    "publish_dir",
    "remove_stale_temps",
    "restore_asides",
    "staged_dir",
    "temp_dir",
    "temp_path",
]

logger = logging.getLogger(__name__)

TEMP_TAG = ".tmp-"
"""Every temporary name is ``.NAME.tmp-OWNER-PID-RANDOM``: OWNER identifies this machine and PID
namespace, so a temp is only ever reaped by a process that can prove its writer is dead."""

_MAX_PLAIN_NAME = 200  # bytes; longer names get a hashed temp name (NAME_MAX is 255)
# A pid has at most 7 digits (Linux's PID_MAX_LIMIT is 2**22): a longer one is no writer's, and
# would overflow os.kill.
_TEMP_RE = re.compile(r"\.(?P<base>.+)\.tmp-(?P<owner>[0-9a-f]{8})-(?P<pid>\d{1,7})-[0-9a-f]{8}")


def _owner_tag() -> str:
    """8 hex digits naming this host, boot and PID namespace.

    A pid only means something inside one PID namespace on one machine: two containers on a
    shared volume can both have a writer with pid 7. Only temps carrying our own tag can be
    checked with ``kill(pid, 0)``; everyone else's are left alone.
    """
    parts = [socket.gethostname(), proc.boot_id(), proc.pid_namespace()]
    return hashlib.sha256("|".join(p for p in parts if p is not None).encode()).hexdigest()[:8]


OWNER = _owner_tag()
"""This machine's, boot's and PID namespace's tag in temporary and aside names."""


def _temp_base(name: str) -> str:
    """The part of a temp name that says which target it belongs to (hashed when too long)."""
    if len(name.encode()) <= _MAX_PLAIN_NAME:
        return name
    return "~" + hashlib.sha256(name.encode()).hexdigest()[:16]


def temp_path(path: str | os.PathLike[str]) -> Path:
    """A fresh temporary name next to ``path``: ``.NAME.tmp-OWNER-PID-RANDOM``.

    Same directory (so the final rename never crosses a filesystem), hidden, never reused,
    and short enough for any legal ``path`` (a name near the 255-byte limit is hashed).
    """
    path = Path(path)
    base = _temp_base(path.name)
    return path.with_name(f".{base}{TEMP_TAG}{OWNER}-{os.getpid()}-{secrets.token_hex(4)}")


def remove_stale_temps(
    directory: str | os.PathLike[str], *, target: str | None = None
) -> list[Path]:
    """Delete temporaries in ``directory`` whose writer is provably dead; return them, sorted.

    Only names of the exact form `temp_path` makes are considered, and only those whose
    OWNER tag is this machine's and PID namespace's, and whose PID is no longer running
    (another writer may be mid-save; a writer in another container cannot be checked, so
    its temps are left). A user's ``.notes.tmp-draft`` is never touched. ``target`` limits
    the sweep to the temporaries of one file or directory name.
    """
    removed = []
    base = None if target is None else _temp_base(target)
    try:
        entries = sorted(Path(directory).iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        match = _TEMP_RE.fullmatch(entry.name)
        if match is None or match["owner"] != OWNER:
            continue
        if base is not None and match["base"] != base:
            continue
        if proc.pid_alive(int(match["pid"])):  # our own pid counts as alive
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
        removed.append(entry)
    return removed


_RENAME_EXCHANGE = 2
ASIDE_TAG = ".aside-"
_ASIDE_RE = re.compile(r"\.(?P<base>.+)\.aside-(?P<owner>[0-9a-f]{8})-(?P<pid>\d{1,7})-[0-9a-f]{8}")


def _aside_path(final: Path) -> Path:
    """Where the fallback parks the committed ``final`` while the new copy is renamed in."""
    return final.with_name(f".{final.name}{ASIDE_TAG}{OWNER}-{os.getpid()}-{secrets.token_hex(4)}")


def restore_asides(root: Path, *, steps: re.Pattern[str]) -> list[Path]:
    """Put back every step a killed publisher left aside in ``root``; return what was restored.

    Only aside names whose base ``steps`` matches in full are considered, each on its own: a
    crafted hidden name (base ``.``, a pid of more digits than any pid) is not a step's and is left
    alone, so it cannot stop every listing of the steps.

    An aside copy is the committed step whenever ``step_N`` itself is missing: it is renamed
    back. When ``step_N`` exists, the new copy made it and the aside is the old one: it is
    removed if its writer is provably dead (this machine, pid gone), else left. Nothing is
    done while the writer may still be between its two renames (this machine, pid alive). A
    writer on another machine cannot be checked: its aside is restored anyway, because a
    hidden step is lost work, while restoring under a live writer costs at most that writer's
    save (its second rename then fails, and it reports the failure).
    """
    restored: list[Path] = []
    try:
        entries = sorted(root.iterdir())
    except OSError:  # missing, not a directory, unreadable: the listing says so, not us
        return restored
    for entry in entries:
        match = _ASIDE_RE.fullmatch(entry.name)
        if match is None or steps.fullmatch(match["base"]) is None:
            continue
        if entry.is_symlink() or not entry.is_dir():
            continue
        ours = match["owner"] == OWNER
        if ours and proc.pid_alive(int(match["pid"])):
            continue
        final = entry.with_name(match["base"])
        if final.exists() or final.is_symlink():
            if ours:  # rename first, so a kill mid-delete never leaves half a step aside
                with contextlib.suppress(OSError):
                    doomed = temp_path(final)
                    os.rename(entry, doomed)
                    shutil.rmtree(doomed, ignore_errors=True)
            continue
        try:
            os.rename(entry, final)
        except FileNotFoundError:  # another rank or process restored it first
            continue
        except OSError as exc:
            logger.warning(
                "cannot restore %s from %s (%s): rename it back by hand", final, entry.name, exc
            )
            continue
        with contextlib.suppress(OSError):
            disk.fsync_dir(root)
        logger.warning("restored %s: a save was killed while it was moved aside", final)
        restored.append(final)
    return restored


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the kernel, libc or filesystem cannot (then the caller falls back).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not supported here
        return False
    raise OSError(err, os.strerror(err), str(b))


def _replace_dir(tmp: Path, final: Path) -> None:
    """Make the complete directory ``tmp`` the step ``final``; an old ``final`` is replaced.

    At every instant a committed ``final`` exists (if one did before): the swap is one atomic
    exchange. Where exchange is unsupported, the old copy is renamed aside (an aside name, see
    `restore_asides`) only after the new copy is complete, and restored if the second rename
    fails, or by the next listing of the steps if this process dies first.
    """
    if not final.exists():
        try:
            os.rename(tmp, final)
            return
        except OSError as exc:
            if not final.exists():
                raise
            # Someone published this step between our check and our rename: fall through.
            logger.warning("%s appeared while saving (%s)", final, exc)
    if _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the old copy
        return
    aside = _aside_path(final)  # not a temp name: a kill before the next rename must not reap it
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rename(aside, final)
        raise
    doomed = temp_path(final)  # now a temp: a kill mid-delete leaves something the sweep reaps
    os.rename(aside, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


Stage = Literal["fsync", "publish", "fsync-parent"]
"""Where `publish_dir` is: fsyncing the new directory, renaming it in, fsyncing its parent."""


def temp_dir(final: Path, *, sweep: Literal["parent", "target"] = "parent") -> Path:
    """A fresh, empty temporary directory next to ``final`` (whose parent must exist).

    First the temporaries dead writers left are removed: every one in the parent (``sweep=
    "parent"``: a checkpoint directory, which only refimpl writes to) or only ``final``'s own
    (``"target"``: a user's directory). Raises OSError when the parent cannot be written.
    """
    remove_stale_temps(final.parent, target=final.name if sweep == "target" else None)
    tmp = temp_path(final)
    tmp.mkdir()
    return tmp


def publish_dir(
    tmp: Path,
    final: Path,
    *,
    replace: bool,
    durable: bool = True,
    stage: Callable[[Stage], None] | None = None,
) -> None:
    """Publish the complete directory ``tmp`` as ``final``: fsync every file and directory in
    it, rename it to ``final``, fsync the parent (the fsyncs only when ``durable``).

    ``replace=False``: ``final`` must not exist (a plain rename, which fails on a non-empty
    ``final``). ``replace=True``: an old ``final`` is swapped out so that a committed copy
    exists at every instant (see the module's docstring). ``stage`` is told each stage before
    it starts, so a caller can say which one failed. Raises OSError from the stage that
    failed; ``tmp`` is left for the caller to remove.
    """
    if durable:
        if stage:
            stage("fsync")
        disk.fsync_tree(tmp)
    if stage:
        stage("publish")
    if replace:
        _replace_dir(tmp, final)
    else:
        os.rename(tmp, final)
    if durable:
        if stage:
            stage("fsync-parent")
        disk.fsync_dir(final.parent)


@contextlib.contextmanager
def staged_dir(
    final: Path,
    *,
    replace: bool,
    durable: bool = True,
    marker: str | None = None,
    sweep: Literal["parent", "target"] = "target",
) -> Iterator[Path]:
    """Yield a fresh temporary directory (`temp_dir`); when the block ends without an
    exception, write the empty ``marker`` file last (if given) and `publish_dir` it as
    ``final``. If the block or the publishing raises, the temporary directory is removed and
    the exception propagates. A failed parent fsync is raised as an OSError that says the
    directory was published but may not survive a power cut.
    """
    tmp = temp_dir(final, sweep=sweep)
    published = False

    def stage(now: Stage) -> None:
        nonlocal published
        published = now == "fsync-parent"

    try:
        yield tmp
        if marker is not None:
            (tmp / marker).touch()  # written last: its presence means "everything is here"
        publish_dir(tmp, final, replace=replace, durable=durable, stage=stage)
    except OSError as exc:
        if not published:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        raise OSError(
            exc.errno,
            f"{final} was published, but syncing {final.parent} failed ({exc.strerror}): "
            "it may not survive a power cut. Check the disk (dmesg)",
        ) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
