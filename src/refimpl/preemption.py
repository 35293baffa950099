"""Preemption: SIGTERM finishes the current step, the trainer saves it and exits 0.

A scheduler that takes the machines back (SLURM's ``--signal``, Kubernetes before its SIGKILL,
a spot instance's notice, torchrun's agent stopping the other workers) sends SIGTERM first and
SIGKILL after a grace period. Python's default for SIGTERM ends the process at once, in the
middle of a step or a save, and everything since the last checkpoint is lost. `StopOnSigterm`
turns the signal into a flag the loop reads between steps::

    with StopOnSigterm() as preempt:
        for step in range(start, steps):
            train_step()
            stop = preempt.should_stop()              # collective: the same answer everywhere
            if step % save_every == 0 or stop:
                save(step)                            # on rank 0, in main_process_first
            if stop:
                sys.exit(0)                           # the scheduler sees a clean exit

`refimpl.train` uses it (its flag rides on the per-step loss all-reduce instead of
`should_stop`'s own). Chapter 10 runs it under torchrun.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StopOnSigterm"]


class StopOnSigterm:
    """Context manager: while inside, SIGTERM sets ``requested`` instead of ending the process.

    The handler only records the signal (``requested`` becomes True, ``received`` counts
    them): Python runs it between bytecodes, possibly in the middle of a print or a save, so
    doing the work there would be unsafe; the loop finishes its step, saves and exits 0. A
    second SIGTERM changes nothing: the step still finishes and saves (a save cut short would
    cost the very step the first signal asked to keep); only the scheduler's SIGKILL, after
    its grace period, ends the process sooner, and an atomic save
    (`refimpl.checkpoint.save_checkpoint`) then leaves the previous step intact. Use SIGINT
    (Ctrl-C), which this leaves alone, to stop at once. The previous handler is put back on
    exit, so it nests inside other programs (`refimpl.launch.spawn`, a notebook).

    Raises RuntimeError on entry outside the main thread: Python delivers signals to the
    main thread only, so a handler installed elsewhere would never run.
    """

    def __init__(self) -> None:
        self.requested = False
        self.received = 0
        self._previous: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        self.received += 1

    def __enter__(self) -> StopOnSigterm:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "StopOnSigterm must be entered in the main thread: Python runs signal "
                "handlers only there. Enter it around the training loop in the main thread."
            )
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def should_stop(self, device: torch.device | str = "cpu") -> bool:
        """Collective: True on every rank once any rank has received SIGTERM.

        Every rank must call it at the same point of each step (it all-reduces one number;
        ``device`` is where that number lives: the rank's GPU under NCCL). The signal may
        reach one rank only (a node's own agent, ``kill`` of one pid), and a rank that stopped
        alone would leave the others waiting in the next step's collectives; with this, all
        stop after the same step. Without a process group it is ``requested``.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
