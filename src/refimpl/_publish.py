"""Publishing a complete step directory under its final name, atomically.

Both file checkpoints (`refimpl.checkpoint`) and sharded ones (`refimpl.sharded`) build a
step in a temporary directory and then make it ``step_N``. A new step is one rename; a
re-saved step is swapped in with Linux's ``renameat2(RENAME_EXCHANGE)`` so that a committed
copy exists at every instant, or, where the kernel or filesystem cannot exchange, by moving
the old copy aside only after the new one is complete.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import sys
from pathlib import Path

from refimpl.atomic import temp_path

logger = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2


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


def publish_dir(tmp: Path, final: Path) -> None:
    """Make the complete directory ``tmp`` the step ``final``; an old ``final`` is replaced.

    At every instant a committed ``final`` exists (if one did before): the swap is one atomic
    exchange. Where exchange is unsupported, the old copy is renamed aside under a temp name
    of ours only after the new copy is complete, and restored if the second rename fails.
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
    aside = temp_path(final)
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rename(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)
