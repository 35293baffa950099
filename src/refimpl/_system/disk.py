"""Making what was written durable: ``fsync`` of a file, a directory, a whole tree.

A write or a rename lives in the page cache until it is synced; a power cut then loses it.
Every caller goes through `fsync`, so the fault injection (`refimpl.demos.io_faults`) swaps
that one name to make a disk fail with ENOSPC or EIO.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["fsync", "fsync_dir", "fsync_path", "fsync_tree"]

fsync: Callable[[int], None] = os.fsync
"""``os.fsync``, through one name the fault injection can swap (call it as ``disk.fsync``)."""


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``fsync`` a directory, making the creations and renames inside it durable.

    A rename only changes the directory; until the directory is synced, a power cut can
    bring back the old entry. Windows cannot open a directory, so this is a no-op there.
    Raises OSError when the directory cannot be opened or synced.
    """
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str | os.PathLike[str]) -> None:
    """``fsync`` the file at ``path`` (opened read-only). Raises OSError when it fails."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


_FSYNC_THREADS = 8
_fsync_pool: ThreadPoolExecutor | None = None


def _forget_pool() -> None:  # a forked child has the pool object but none of its threads
    global _fsync_pool
    _fsync_pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file, then every directory bottom-up, under ``root``.

    The files of a directory are fsynced concurrently: one after another, each fsync waits
    for its own journal commit (14 small files cost 14 commits); issued together, the
    filesystem folds them into one (ext4 and xfs commit concurrent fsyncs as a group). Every
    one has returned, or the first error is raised, before the directory is fsynced.
    """
    global _fsync_pool
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        paths = [os.path.join(dirpath, name) for name in filenames]
        if _fsync_pool is None and len(paths) > 1:
            _fsync_pool = ThreadPoolExecutor(_FSYNC_THREADS, thread_name_prefix="fsync")
        try:
            pending = [_fsync_pool.submit(fsync_path, p) for p in paths] if _fsync_pool else []
        except RuntimeError:  # at interpreter exit (a background save finishing): one by one
            pending = []
        for done in pending:
            done.result()  # waits for all of them; raises the first failure
        for path in paths if not pending else []:
            fsync_path(path)
        fsync_dir(dirpath)
