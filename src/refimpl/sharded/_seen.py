"""When a rank may rely on rank 0's digest of a file instead of hashing it again.

`refimpl.sharded.load_sharded` has rank 0 verify every file of a step against the manifest,
and every rank verify the files it is about to read (`refimpl.sharded._read.VerifyingReader`),
because a rank may read another copy than rank 0 did: another node's disk or cache, or a file
changed or swapped after rank 0's check. On rank 0's own machine, reading the very inode rank
0 hashed, unchanged since, the second hash proves nothing new, and it costs the most exactly
when the world size changed: a rank then reads parts of several savers' files, and hashing a
file means reading all of it.

`Seen` is what rank 0 records while it hashes a file: the machine (``boot_id``), the inode
(device and number), and the size, modification and change times, taken from the descriptor
it hashes, before and after hashing (a file that changed meanwhile gets no record). Another
rank skips its own hash only when its open descriptor shows the same machine, inode, size and
times. Any write to the file, or a rename of another file over its name, changes one of them
(``st_ctime`` is set by the kernel on every write and cannot be set by ``utime``). A write in
the same timestamp tick as the save itself could leave the times unchanged, so a file
modified less than `RACY_S` seconds before rank 0 looked at it gets no record either, and
every rank hashes it (git's "racy clean" rule for its index, for the same reason).
"""

from __future__ import annotations

import os
import time

from refimpl._system import proc

Seen = tuple[str, int, int, int, int, int]
"""``(boot_id, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of a file rank 0 hashed."""

RACY_S = 2.0
"""A file changed less than this many seconds before rank 0 looked at it is always re-hashed
(covers filesystems whose timestamps have a 1-second granularity)."""


BOOT_ID = proc.boot_id() or None  # None off Linux: no way to tell machines apart, so always hash


def _identity(fd: int) -> Seen | None:
    st = os.fstat(fd)
    if BOOT_ID is None:
        return None
    return (BOOT_ID, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def before_hashing(fd: int) -> Seen | None:
    """The record to keep for ``fd``, taken before hashing it; None when the file changed
    less than `RACY_S` seconds ago (or the machine cannot be named)."""
    seen = _identity(fd)
    if seen is None or time.time_ns() - max(seen[4], seen[5]) < RACY_S * 1e9:
        return None
    return seen


def after_hashing(fd: int, seen: Seen | None) -> Seen | None:
    """``seen`` if ``fd`` still shows it after hashing, else None (it changed meanwhile)."""
    return seen if seen is not None and _identity(fd) == seen else None


def unchanged(fd: int, seen: Seen | None) -> bool:
    """Whether the open ``fd`` is, on this machine, the file rank 0 hashed, unchanged."""
    return seen is not None and _identity(fd) == seen
