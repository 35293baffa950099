"""Chapter 5: save a file or a directory so that a crash leaves the old version or the new one.

A plain ``torch.save(obj, path)`` truncates ``path`` and then writes it: a process killed
half-way (SIGKILL, OOM killer, a pre-empted node) leaves a torn file under the final name,
and the next run's ``torch.load`` fails on it. Every writer here follows one protocol:

1. write to a uniquely named temporary file *in the same directory* (so the rename in step
   3 never crosses a filesystem),
2. flush Python's buffer and ``fsync`` the file, so its bytes are on disk before its name is,
3. ``os.replace`` it over the final name: on POSIX a reader sees the old file or the new
   one, never a mix,
4. ``fsync`` the directory, so the rename itself survives a power cut,

and on any error removes the temporary file and re-raises. `atomic_dir` does the same for a
directory of files, and writes a commit marker last.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
import xxhash

from refimpl import _publish
from refimpl._publish import remove_stale_temps, temp_path
from refimpl._system import disk
from refimpl._system.disk import fsync_dir
from refimpl._write_errors import WatchedFile, interrupt_in, oserror_advice, root_oserror

__all__ = [
    "COMMIT_MARKER",
    "DIGESTS",
    "TEMP_TAG",
    "atomic_dir",
    "atomic_save",
    "atomic_write",
    "atomic_write_bytes",
    "fsync_dir",
    "remove_stale_temps",
    "temp_path",
]

TEMP_TAG = _publish.TEMP_TAG
"""Every temporary name is ``.NAME.tmp-OWNER-PID-RANDOM``: OWNER identifies this machine and PID
namespace, so a temp is only ever reaped by a process that can prove its writer is dead."""
COMMIT_MARKER = "COMMITTED"
"""`atomic_dir` writes this empty file last: a directory without it is not a checkpoint."""

# An indirection the fault injection (refimpl.demos.io_faults) swaps, as it swaps disk.fsync.
_replace: Callable[[Any, Any], None] = os.replace


def _open_temp(path: Path) -> tuple[IO[bytes], Path]:
    """Create and open a temp next to ``path`` (exclusive), with the mode ``path`` has.

    A replaced file keeps its permission bits (a 0600 token stays 0600); a new file gets
    0666 minus the umask, as ``open()`` would give it.
    """
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.fchmod(fd, os.stat(path).st_mode & 0o7777)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return os.fdopen(fd, "wb"), tmp


DIGESTS: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128}
"""Digest algorithms `atomic_write` can compute while writing, by name."""


class _HashingFile:
    """A write-only file wrapper that feeds every byte written into a digest."""

    def __init__(self, f: IO[bytes] | WatchedFile, algorithm: str) -> None:
        self._f = f
        self.hash = DIGESTS[algorithm]()

    def write(self, data: Any) -> int:
        self.hash.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def atomic_write(
    path: str | os.PathLike[str],
    write: Callable[[IO[bytes]], Any],
    *,
    durable: bool = True,
    sha256: bool = False,
    digest: str | None = None,
) -> str | None:
    """Call ``write(f)`` on a temporary file, then move it over ``path`` atomically.

    This is the protocol every other writer here uses: temp file in the same directory,
    flush, fsync, ``os.replace``, fsync of the directory (``durable=False`` skips both
    fsyncs: still atomic against a killed process, not against a power cut). On any error
    the temporary file is removed, ``path`` is left as it was, and an ``OSError`` naming
    ``path`` and the errno is raised (its message one fact per line: what failed, what was
    left as it was, what to do next). Returns the hex digest of the bytes written when
    ``digest`` names an algorithm of `DIGESTS` (``sha256=True`` means ``digest="sha256"``),
    computed while writing, so the file is never read back; else None.

    Links: when ``path`` is a symlink, its target is replaced and the link kept. A hard link
    to the old file keeps the old contents: a rename gives the name a new inode, so other
    names of the old inode are not updated; a ``RuntimeWarning`` says so. Chosen over the
    alternatives because it loses nothing: writing in place would keep the link but let a
    crash tear the file under every name, and refusing would lose the save. The replaced
    file's permission bits are kept.
    Temporaries that a killed earlier writer of ``path`` left behind are removed first.

    Example::

        atomic_write("notes.txt", lambda f: f.write(b"hello"))
    """
    algorithm = digest or ("sha256" if sha256 else None)
    path = Path(path)
    if path.is_symlink():  # replace the link's target and keep the link
        path = Path(os.path.realpath(path))
    remove_stale_temps(path.parent, target=path.name)
    try:
        links = os.stat(path).st_nlink
    except OSError:
        links = 1
    try:
        f, tmp = _open_temp(path)
    except OSError as exc:  # name the user's file and directory, not a temp that never was
        raise OSError(  # OSError(errno, ...) is the errno's subclass (FileNotFoundError, ...)
            exc.errno,
            f"cannot write {path}:\ncreating a temporary file in {path.parent} failed "
            f"({exc.strerror or exc}).\n{oserror_advice(exc, path)}",
        ) from exc
    watched = WatchedFile(f)
    stage = "serialise"  # then "write": from here on every OSError is the file's
    try:
        with f:
            sink: Any = _HashingFile(watched, algorithm) if algorithm else watched
            write(sink)
            stage = "write"
            watched.flush()  # Python's buffer -> the kernel
            if durable:
                disk.fsync(f.fileno())  # the kernel's page cache -> the disk
        _replace(tmp, path)  # atomic on POSIX: the old file or the new one, never a mix
        stage = "sync"
        if durable:
            fsync_dir(path.parent)
    except BaseException as exc:  # KeyboardInterrupt must clean up too
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        interrupt = interrupt_in(exc)
        if interrupt is not None and interrupt is not exc:
            raise interrupt from exc  # Ctrl-C stays Ctrl-C, so `except KeyboardInterrupt` runs
        # While serialising, only what the file itself raised is a write error; an OSError
        # from the object's own pickling (a __reduce__ that raises) is the caller's, as is.
        os_error = watched.error if stage == "serialise" else root_oserror(exc)
        if os_error is not None and stage == "sync":
            raise OSError(
                os_error.errno,
                f"{path} was written and renamed,\nbut syncing its directory failed "
                f"({os_error.strerror or os_error}): the new file may not survive a power cut.\n"
                "Check the disk (dmesg) and save again",
            ) from exc
        if os_error is not None:
            raise OSError(
                os_error.errno,
                f"atomic write of {path} failed ({os_error.strerror or os_error});\n"
                f"the previous {path.name} is untouched and the temporary file was removed.\n"
                f"{oserror_advice(os_error, path)}",
            ) from exc
        raise
    if links > 1:
        warnings.warn(
            f"{path} had {links} hard links: the atomic replace gave it a new inode, so its other "
            f"{links - 1} name(s) still hold the previous contents. Nothing was lost; re-link "
            "them (or use a symlink, which is followed) if they should see the new file",
            RuntimeWarning,
            stacklevel=3,
        )
    return str(sink.hash.hexdigest()) if algorithm else None


def atomic_write_bytes(
    data: bytes | bytearray | memoryview, path: str | os.PathLike[str], *, durable: bool = True
) -> Path:
    """Write ``data`` to ``path`` atomically and durably; returns ``path`` as a `Path`.

    Example::

        atomic_write_bytes(b'{"step": 10}', "latest.json")
    """
    atomic_write(path, lambda f: f.write(data), durable=durable)
    return Path(path)


def atomic_save(obj: Any, path: str | os.PathLike[str], *, durable: bool = True) -> Path:
    """``torch.save(obj, path)`` that a crash cannot tear; returns ``path`` as a `Path`.

    After this returns, ``path`` holds ``obj`` and survives a power cut; if the process dies
    first, ``path`` still holds whatever it held before (or does not exist).

    Example::

        atomic_save(model.state_dict(), "model.pt")
    """
    atomic_write(path, lambda f: torch.save(obj, f), durable=durable)
    return Path(path)


@contextlib.contextmanager
def atomic_dir(
    path: str | os.PathLike[str], *, marker: str | None = COMMIT_MARKER, durable: bool = True
) -> Iterator[Path]:
    """Build a directory under a temporary name; publish it as ``path`` only if the block ends.

    Yields an empty temporary directory next to ``path``. When the ``with`` block finishes
    without an exception, every file in it is fsynced, the ``marker`` file is written last,
    the directory is renamed to ``path`` (atomic on POSIX) and the parent is fsynced. If the
    block raises, the temporary directory is deleted and ``path`` is not touched. ``path``
    must not exist yet: renaming over a non-empty directory is not possible on POSIX.

    Example::

        with atomic_dir("ckpt/step_00000100") as tmp:
            torch.save(model.state_dict(), tmp / "model.pt")
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(
            f"{path} already exists; atomic_dir only creates new directories. Remove it or "
            "pick a new name (checkpoints use one directory per step)."
        )
    with _publish.staged_dir(path, replace=False, durable=durable, marker=marker) as tmp:
        yield tmp
