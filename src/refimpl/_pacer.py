"""Pacing a background writer to a share of one core: shared by chapter 9's sharded writer
(`refimpl._paced_writer`) and the file checkpoints' `refimpl.checkpoint.AsyncCheckpointer`.
The measurements that motivate it are in `refimpl._paced_writer`'s docstring and chapter 9.
"""

from __future__ import annotations

import threading
import time

__all__ = ["PIECE_BYTES", "Pacer", "check_cpu_share"]

PIECE_BYTES = 1 << 20
"""The most a paced write hands the kernel at once: a sleep can follow every piece, so a
step overlapping the write meets at most one piece's copy (about a third of a millisecond
here) before the writer yields."""


def check_cpu_share(share: float | None) -> None:
    """Refuse a ``cpu_share`` that is neither None nor a number in (0, 1]."""
    if share is not None and not (isinstance(share, int | float) and 0 < share <= 1):
        raise ValueError(f"cpu_share must be a number in (0, 1] or None, got {share!r}")


class Pacer:
    """Sleeps whenever the calling thread's CPU time is ahead of ``share`` times the wall time
    since `start` (each thread that writes keeps its own clock); never, for ``share`` None.

    A background writer calls `wait` after each piece it hands the kernel (`PIECE_BYTES`)."""

    def __init__(self, share: float | None) -> None:
        self.share = share
        self._clock = threading.local()

    def start(self) -> None:
        """Start this thread's clock: its CPU time and the wall time are counted from now."""
        self._clock.cpu0, self._clock.wall0 = time.thread_time(), time.monotonic()

    def wait(self) -> None:
        """Sleep until this thread's CPU time is at most ``share`` of the wall time since
        `start` (a thread that never called `start` starts its clock now)."""
        if self.share is None:
            return
        if not hasattr(self._clock, "cpu0"):  # a writing thread of DCP's own (thread_count > 1)
            self.start()
        ahead = (time.thread_time() - self._clock.cpu0) / self.share
        ahead -= time.monotonic() - self._clock.wall0
        if ahead > 0:
            time.sleep(ahead)
