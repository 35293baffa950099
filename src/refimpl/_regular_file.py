"""Read the small files of a checkpoint (manifest, ``.metadata``) without blocking or following
links.

A checkpoint directory is untrusted input: ``MANIFEST.json`` may be a FIFO (``open`` then waits
for a writer forever), a symbolic link to ``/dev/zero`` (``read`` never ends) or to a tty, or a
link that points out of the step. `read_regular` therefore ``lstat``\\ s first, opens with
``O_NOFOLLOW | O_NONBLOCK`` (a FIFO opened that way returns at once; a link is refused by the
kernel with ELOOP), checks with ``fstat`` that what was opened is the same regular file, and
reads at most ``limit`` bytes. Its refusals are `NotRegularFile`, an ``OSError``, so every
caller's existing ``except OSError`` reports them as an unreadable file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
"""How a checkpoint's files are opened for reading: never through a link, never waiting."""


class NotRegularFile(OSError):
    """The path is not a plain file (a FIFO, a device, a link, ...) or is larger than allowed."""


def kind_of(mode: int) -> str:
    """``"a FIFO (named pipe)"``, ``"a symbolic link"``, ... for an ``st_mode``."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def is_regular(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` itself (not what a link points to) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular(path: str | os.PathLike[str]) -> int:
    """A file descriptor of ``path`` opened read-only, refused unless it is a regular file.

    Raises `NotRegularFile` for a link, FIFO, device, socket or directory (without reading
    from it), other ``OSError``\\ s as ``os.open`` does. The caller closes the descriptor.
    """
    mode = os.lstat(path).st_mode  # refuse before opening: opening some devices has effects
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"{path} is {kind_of(mode)}, not a regular file")
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a link after the lstat
            raise NotRegularFile(f"{path} is a symbolic link, not a regular file") from exc
        raise
    mode = os.fstat(fd).st_mode  # what was opened, in case it was swapped after the lstat
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(f"{path} is {kind_of(mode)}, not a regular file")
    os.set_blocking(fd, True)  # a regular file never blocks; reads are ordinary from here
    return fd


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them, else `NotRegularFile`.

    Never blocks on a FIFO or device and never follows a link (see the module docstring).
    """
    fd = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise NotRegularFile(f"{Path(path)} is larger than {limit} bytes, the most allowed here")
    return data
