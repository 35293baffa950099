"""Chapter 9: a background checkpoint write in small pieces, paced to a share of one core.

An async save's writing thread needs CPU time: serialising, and copying every byte into the
page cache (the kernel's copy counts as the thread's time). On a machine whose training keeps
every core busy, that time is taken from training, and a step that overlaps the write's busiest
moments is slowed the most (a parallel step waits for its slowest thread).

`PacedWriter` changes two things in a background write. It hands the kernel at most
`PIECE_BYTES` at a time: DCP's ``FileSystemWriter`` writes each tensor's record in one call
(32 MiB for a 256 MiB state of eight tensors), and beside a training step on both cores of the
book's machine, the same bytes in 1 MiB pieces took the writing thread 0.07 CPU-seconds
instead of 0.23, and the save finished in 0.21 s instead of 0.43 (one run; in three more, the
whole-record writer took 0.42-0.62 s against 0.09-0.11 for the paced ones). Written alone, the
piece size made no difference (0.06 CPU-s for 256 MiB either way), so the cost is one of
contention: our guess, not isolated, is that a 32 MiB copy evicts the training threads' data
from the 32 MiB L3 cache they share. And with ``cpu_share``, after each piece it sleeps until
the thread's CPU time is at most ``cpu_share`` of the wall time since the write began, so no
step loses more than about that share of a core; the checkpoint commits later, by about
``1 / cpu_share`` times the writer's CPU time (``python -m refimpl.bench save``, chapter 9).

Only a background write is changed: a thread that created the writer (a synchronous
``dcp.save``) writes as ``FileSystemWriter`` does, as with
`refimpl._low_priority.LowPriorityWriter`, whose nice value this writer also applies. The files
are ``FileSystemWriter``'s: plain ``dcp.load`` reads them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from refimpl._low_priority import LowPriorityWriter

__all__ = ["PIECE_BYTES", "PacedWriter"]

PIECE_BYTES = 1 << 20
"""The most a paced write hands the kernel at once: a sleep can follow every piece, so a
step overlapping the write meets at most one piece's copy (about a third of a millisecond
here) before the writer yields."""


class _Pacer:
    """Sleeps whenever the calling thread's CPU time is ahead of ``share`` times the wall time
    since `start` (each thread that writes keeps its own clock); never, for ``share`` None."""

    def __init__(self, share: float | None) -> None:
        self.share = share
        self._clock = threading.local()

    def start(self) -> None:
        self._clock.cpu0, self._clock.wall0 = time.thread_time(), time.monotonic()

    def wait(self) -> None:
        if self.share is None:
            return
        if not hasattr(self._clock, "cpu0"):  # a writing thread of DCP's own (thread_count > 1)
            self.start()
        ahead = (time.thread_time() - self._clock.cpu0) / self.share
        ahead -= time.monotonic() - self._clock.wall0
        if ahead > 0:
            time.sleep(ahead)


class _PacedStream:
    """A file that hands its writes to the real one in `PIECE_BYTES` pieces, pacing each."""

    def __init__(self, raw: Any, pacer: _Pacer) -> None:
        self._raw = raw
        self._pacer = pacer

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), PIECE_BYTES):
            self._raw.write(view[start : start + PIECE_BYTES])
            self._pacer.wait()
        return len(view)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close: the real file's
        return getattr(self._raw, name)


class _PacedFileSystem(FileSystem):
    def __init__(self, pacer: _Pacer) -> None:
        self._pacer = pacer

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as stream:
            yield _PacedStream(stream, self._pacer) if "w" in mode else stream


class PacedWriter(LowPriorityWriter):
    """refimpl's DCP writer (no per-record CRC-32, a nice value for its thread) whose background
    writes go to the kernel in `PIECE_BYTES` pieces and use at most ``cpu_share``
    (0 < share <= 1) of one core; ``None`` or 1: pieces, unpaced. ``nice`` is
    `LowPriorityWriter`'s, here 0 (the caller's priority) by default."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        cpu_share: float | None = None,
        nice: int = 0,
        **kwargs: Any,
    ) -> None:
        if cpu_share is not None and not (
            isinstance(cpu_share, int | float) and 0 < cpu_share <= 1
        ):
            raise ValueError(f"cpu_share must be a number in (0, 1] or None, got {cpu_share!r}")
        super().__init__(path, nice=nice, **kwargs)
        self.cpu_share = cpu_share

    def write_data(self, plan: Any, planner: Any) -> Any:
        """Write as `DigestedWriter` does; in a background thread, in `PIECE_BYTES` pieces,
        paced to ``cpu_share`` when one is set."""
        if self._in_creator_thread():
            return super().write_data(plan, planner)
        pacer = _Pacer(None if self.cpu_share == 1 else self.cpu_share)
        pacer.start()
        unpaced, self.fs = self.fs, _PacedFileSystem(pacer)
        try:
            return super().write_data(plan, planner)
        finally:
            self.fs = unpaced
