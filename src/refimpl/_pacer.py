"""Pacing a background writer to a share of one core: shared by chapter 9's sharded writer
(`refimpl.sharded._paced_writer`) and the file checkpoints' `refimpl.checkpoint.AsyncCheckpointer`.

A writer calls `Pacer.wait` after each piece (`PIECE_BYTES`) it hands the kernel; the pacer
sleeps while the writing thread's CPU time is ahead of its share of the wall time. Shares below
`MIN_CPU_SHARE` are refused, no single sleep lasts longer than `MAX_SLEEP_S`, and `stop_pacing`
(called at interpreter exit) ends every sleep so a save still writing finishes at full speed.
`lower_thread_priority` is the other way a writing thread yields the cores: a higher nice value.
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = [
    "MAX_SLEEP_S",
    "MIN_CPU_SHARE",
    "PIECE_BYTES",
    "Pacer",
    "check_cpu_share",
    "lower_thread_priority",
    "stop_pacing",
]

PIECE_BYTES = 1 << 20
"""The most a paced write hands the kernel at once: a sleep can follow every piece, so a step
overlapping the write meets at most one piece's copy before the writer yields."""

MIN_CPU_SHARE = 0.01
"""The smallest ``cpu_share`` accepted (1% of a core). The write takes about its CPU time
divided by the share: at a share of 1e-7, one piece's fraction of a millisecond would buy
hours of sleep, and the checkpoint would never commit."""

MAX_SLEEP_S = 1.0
"""The longest one sleep between two pieces: however far ahead the writer's CPU clock is (a
burst of serialising, a clock that jumped), the write hands the kernel a piece at least this
often."""

_UNPACED = threading.Event()  # set by stop_pacing: every sleep ends, no new one starts


def check_cpu_share(share: float | None) -> None:
    """Refuse a ``cpu_share`` that is neither None nor a number from `MIN_CPU_SHARE` to 1
    (``True`` and NaN included), with a ``ValueError``: a share that small never commits."""
    if share is None:
        return
    if isinstance(share, bool) or not isinstance(share, int | float):
        ok = False
    else:
        ok = MIN_CPU_SHARE <= share <= 1
    if not ok:
        raise ValueError(
            f"cpu_share must be a number in [{MIN_CPU_SHARE}, 1] or None, got {share!r} "
            f"(below {MIN_CPU_SHARE} of a core the paced write would take longer than any "
            "training run; None writes unpaced)"
        )


def stop_pacing() -> None:
    """End every paced write's sleep now and pace nothing from here on, in this process.

    Called when the process exits (`refimpl.sharded._async_handle`): a save still writing then
    finishes at full speed instead of keeping the process alive for its sleeps."""
    _UNPACED.set()


class Pacer:
    """Sleeps whenever the calling thread's CPU time is ahead of ``share`` times the wall time
    since `start` (each thread that writes keeps its own clock); never, for ``share`` None."""

    def __init__(self, share: float | None) -> None:
        self.share = share
        self._clock = threading.local()

    def start(self) -> None:
        """Start this thread's clock: its CPU time and the wall time are counted from now."""
        self._clock.cpu0, self._clock.wall0 = time.thread_time(), time.monotonic()

    def wait(self) -> None:
        """Sleep until this thread's CPU time is at most ``share`` of the wall time since
        `start`, or `MAX_SLEEP_S`, or until `stop_pacing` (a thread that never called `start`
        starts its clock now)."""
        if self.share is None or _UNPACED.is_set():
            return
        if not hasattr(self._clock, "cpu0"):  # a writing thread of DCP's own (thread_count > 1)
            self.start()
        ahead = (time.thread_time() - self._clock.cpu0) / self.share
        ahead -= time.monotonic() - self._clock.wall0
        if ahead > 0:
            _UNPACED.wait(min(ahead, MAX_SLEEP_S))  # a sleep that stop_pacing ends


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
