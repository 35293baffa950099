"""Publishing a complete step directory under its final name, atomically.

Both file checkpoints (`refimpl.checkpoint`) and sharded ones (`refimpl.sharded`) build a
step in a temporary directory and then make it ``step_N``. A new step is one rename; a
re-saved step is swapped in with Linux's ``renameat2(RENAME_EXCHANGE)`` so that a committed
copy exists at every instant, or, where the kernel or filesystem cannot exchange, by moving
the old copy aside only after the new one is complete.

That fallback has a window: between "old copy aside" and "new copy in", no ``step_N``
exists. A writer killed there leaves the committed step under its aside name,
``.step_N.aside-OWNER-PID-RANDOM``: a tag of its own, which the stale-temp sweep
(`refimpl.atomic.remove_stale_temps`) never matches, and which `restore_asides` (called by
every listing of the steps, so before any load, prune or cleanup) renames back.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import secrets
import shutil
import sys
from pathlib import Path

from refimpl._system.proc import pid_alive
from refimpl.atomic import _OWNER, fsync_dir, temp_path

logger = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2
ASIDE_TAG = ".aside-"
_ASIDE_RE = re.compile(r"\.(?P<base>.+)\.aside-(?P<owner>[0-9a-f]{8})-(?P<pid>\d{1,7})-[0-9a-f]{8}")


def _aside_path(final: Path) -> Path:
    """Where the fallback parks the committed ``final`` while the new copy is renamed in."""
    return final.with_name(f".{final.name}{ASIDE_TAG}{_OWNER}-{os.getpid()}-{secrets.token_hex(4)}")


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
        ours = match["owner"] == _OWNER
        if ours and pid_alive(int(match["pid"])):
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
            logger.warning("cannot restore %s from %s (%s): rename it back by hand",
                           final, entry.name, exc)  # fmt: skip
            continue
        with contextlib.suppress(OSError):
            fsync_dir(root)
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


def publish_dir(tmp: Path, final: Path) -> None:
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
