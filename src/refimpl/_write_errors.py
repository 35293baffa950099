"""What a failed write says: which error was the disk's, and what to do about it.

`refimpl.atomic` writes through a temporary file; when that fails, the user must hear about
*their* file (never the temporary name, which no longer exists), and the advice must fit the
cause: "free some space" for ENOSPC, "check the permissions" for EACCES, "check the disk" only
for an error the device reported (EIO and kin). An error raised while the object was being
serialised (a ``__reduce__`` that raises, even an OSError) is the caller's, not the disk's:
`WatchedFile` records the errors that the file itself raised, so the two can be told apart.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import IO, Any

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# Errors the device or the filesystem reports about itself: only these get "check the disk".
DEVICE = tuple(
    getattr(errno, name)
    for name in ("EIO", "EUCLEAN", "ESTALE", "ENODEV", "ENXIO", "EREMOTEIO")
    if hasattr(errno, name)
)
PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)


class WatchedFile:
    """A file wrapper that remembers the first OSError its own ``write`` or ``flush`` raised.

    Everything else is delegated, so ``torch.save`` and any writer see the file they expect.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def root_oserror(exc: BaseException, *, innermost: bool = False) -> OSError | None:
    """The OSError behind ``exc`` (the first in the chain, or the ``innermost``), if any.

    torch.save's zip writer turns a failed write into ``RuntimeError: unexpected pos`` when
    it closes the archive; the ENOSPC/EIO that caused it is only in the exception chain. The
    innermost one is the system's own, before any message of ours was wrapped around it.
    """
    found: OSError | None = None
    seen: BaseException | None = exc
    for _ in range(20):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno is not None:
            found = seen
            if not innermost:
                break
        seen = seen.__cause__ or seen.__context__
    return found


def interrupt_in(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt behind ``exc``: torch.save's zip writer re-raises a Ctrl-C that
    arrived mid-write as ``RuntimeError: unexpected pos``, with the interrupt as context."""
    seen: BaseException | None = exc
    for _ in range(20):
        if seen is None:
            return None
        if isinstance(seen, KeyboardInterrupt):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def oserror_advice(err: OSError, path: Path) -> str:
    """What to do next about ``err``, raised while writing ``path``."""
    if err.errno in DISK_FULL:
        return "Free some space (or raise the quota), then save again"
    if err.errno in PERMISSION:
        return "Check the directory's permissions and that the filesystem is writable"
    if err.errno in DEVICE:
        return "Check the disk (dmesg) and save again"
    if err.errno == errno.EISDIR:
        return f"{path} is a directory: pass the name of a file"
    if err.errno in (errno.ENOENT, errno.ENOTDIR):
        return f"{path.parent} does not exist (or is not a directory): create it first"
    if err.errno == errno.ENAMETOOLONG:
        return "The name is too long for this filesystem: choose a shorter one"
    return "Fix what the error says, then save again"
