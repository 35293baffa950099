"""Chapter 9: background checkpoint writes that take only the CPU time training leaves idle.

A thread writing a checkpoint competes with the training threads for the same cores. Linux
keeps a scheduling priority per thread, so the writing thread alone can be given a higher
nice value: the scheduler then runs it first when a core would otherwise idle.

What that buys depends on idle cores: the write's CPU work is moved, not removed, and a
write at low priority becomes durable later. Where training keeps every core busy it can
buy nothing (chapter 9 and ``python -m refimpl.bench save`` measure it).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from refimpl._pacer import lower_thread_priority
from refimpl.sharded._digested_writer import DigestedWriter

__all__ = ["WRITER_NICE", "LowPriorityWriter", "lower_thread_priority"]

WRITER_NICE = 19  # LowPriorityWriter's default; AsyncSaver's is 0 (the docstring says why)


class LowPriorityWriter(DigestedWriter):
    """refimpl's `DigestedWriter` (DCP's ``FileSystemWriter`` without ``torch.save``'s
    per-record CRC-32) whose writing thread runs at nice ``nice`` (Linux).

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

    def _in_creator_thread(self) -> bool:
        return (os.getpid(), threading.get_native_id()) == self._creator

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Lower this thread's priority (unless it created the writer), then set up as
        ``FileSystemWriter`` does."""
        if not self._in_creator_thread():
            lower_thread_priority(self.nice)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
