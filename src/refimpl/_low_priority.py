"""Chapter 9: background checkpoint writes that take only the CPU time training leaves idle.

A thread writing a checkpoint competes with the training threads for the same cores: on the
book's 2-core machine, a step overlapping DCP's thread writer ran about 1.3x as long as a
step alone (`python -m refimpl.bench save --sizes-mb`). Linux keeps a scheduling priority per
thread, so the writing thread alone can be given a higher nice value: the scheduler then runs
it when a core would otherwise idle, and the training threads keep their share.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter

__all__ = ["WRITER_NICE", "LowPriorityWriter", "lower_thread_priority"]

WRITER_NICE = 19  # AsyncSaver's default: see the class docstring for the numbers


def lower_thread_priority(nice: int) -> bool:
    """Raise the calling thread's nice value to at least ``nice`` (lower its CPU priority).

    Linux keeps a nice value per thread, so this leaves the training thread alone; elsewhere
    ``setpriority`` would renice the whole process, so it does nothing there and returns False.
    Never lowers a nice value already higher (that needs privileges and would boost the
    thread). Returns whether the thread now runs at ``nice`` or above."""
    if sys.platform != "linux" or nice <= 0:
        return False
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        return False
    return True


class LowPriorityWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose writing thread runs at nice ``nice`` (Linux).

    ``dcp.save`` calls ``set_up_storage_writer`` in the thread that then plans and writes:
    for ``dcp.async_save``, its background thread (or, with
    ``AsyncCheckpointerType.PROCESS``, DCP's checkpoint daemon), so the serialisation and the
    copies into the page cache take only CPU time the training threads leave idle. The
    thread that created the writer is never reniced: a synchronous ``dcp.save`` with this
    writer runs at the caller's priority. The files are ``FileSystemWriter``'s: plain
    ``dcp.load`` reads them."""

    def __init__(
        self, path: str | os.PathLike[str], *, nice: int = WRITER_NICE, **kwargs: Any
    ) -> None:
        super().__init__(path, **kwargs)
        self.nice = nice
        self._creator = (os.getpid(), threading.get_native_id())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Lower this thread's priority (unless it created the writer), then set up as
        ``FileSystemWriter`` does."""
        if (os.getpid(), threading.get_native_id()) != self._creator:
            lower_thread_priority(self.nice)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
