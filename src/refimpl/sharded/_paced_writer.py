"""Chapter 9: a background checkpoint write paced to a share of one core.

An async save's writing thread needs CPU time: serialising, and copying every byte into the
page cache (the kernel's copy counts as the thread's time). On a machine whose training keeps
every core busy, that time is taken from training, and the steps that overlap the write's
busiest moments are slowed the most (a parallel step waits for its slowest thread): DCP's
``FileSystemWriter`` hands the kernel a whole tensor record per write call.

With ``cpu_share`` set, `PacedWriter` hands the kernel at most `PIECE_BYTES` per call and,
after each piece, sleeps until the writing thread's CPU time is at most ``cpu_share`` of the
wall time since the write began: the same CPU seconds, spread thin, so that a step overlaps at
most one piece's copy before the writer yields. The checkpoint commits after about the
writer's CPU seconds divided by the share; pieces without the sleeps (``cpu_share=1``)
only change the size of each call. Chapter 9 and ``python -m refimpl.bench save`` measure
the steps and the commit time both ways.

A share is at least `MIN_CPU_SHARE`, one sleep at most `MAX_SLEEP_S`, and `stop_pacing` (called
when the process exits, `refimpl.sharded._async`) ends every sleep: pacing spreads a write out
while training runs, it must never keep a checkpoint from committing or a process from exiting.

Only a background write is paced: a thread that created the writer (a synchronous
``dcp.save``) writes as ``FileSystemWriter`` does, as with
`refimpl.sharded._low_priority.LowPriorityWriter`, whose nice value this writer also
applies. The files are ``FileSystemWriter``'s: plain ``dcp.load`` reads them.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from refimpl._pacer import (
    MAX_SLEEP_S,
    MIN_CPU_SHARE,
    PIECE_BYTES,
    Pacer,
    check_cpu_share,
    stop_pacing,
)
from refimpl.sharded._low_priority import LowPriorityWriter

__all__ = [
    "MAX_SLEEP_S",
    "MIN_CPU_SHARE",
    "PIECE_BYTES",
    "PacedWriter",
    "check_cpu_share",
    "stop_pacing",
]

_Pacer = Pacer  # the tests patch its wait through this module


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
        super().__init__()
        self._pacer = pacer

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as stream:
            yield _PacedStream(stream, self._pacer) if "w" in mode else stream


class PacedWriter(LowPriorityWriter):
    """refimpl's DCP writer (no per-record CRC-32, a nice value for its thread) whose background
    writes use at most ``cpu_share`` (`MIN_CPU_SHARE` <= share <= 1, else ``ValueError``) of
    one core, in `PIECE_BYTES` pieces; 1: pieces, unpaced; ``None`` (the default):
    `LowPriorityWriter`'s writes. ``nice`` is `LowPriorityWriter`'s, here 0 (the caller's
    priority) by default."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        cpu_share: float | None = None,
        nice: int = 0,
        **kwargs: Any,
    ) -> None:
        check_cpu_share(cpu_share)
        super().__init__(path, nice=nice, **kwargs)
        self.cpu_share = cpu_share

    def write_data(self, plan: Any, planner: Any) -> Any:
        """Write as `DigestedWriter` does; in a background thread with ``cpu_share`` set, in
        `PIECE_BYTES` pieces, paced to that share."""
        if self.cpu_share is None or self._in_creator_thread():
            return super().write_data(plan, planner)
        pacer = _Pacer(None if self.cpu_share == 1 else self.cpu_share)
        pacer.start()
        unpaced, self.fs = self.fs, _PacedFileSystem(pacer)
        try:
            return super().write_data(plan, planner)
        finally:
            self.fs = unpaced
