"""Workers for tests/test_preemption.py (spawned ranks import them by name)."""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

from refimpl.preemption import StopOnSigterm


def stop_when_one_rank_is_signalled() -> tuple[int, bool]:
    """Steps until `should_stop`; rank 1 sends itself SIGTERM in step 3. Returns the last
    step and whether the SIGTERM handler was put back afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSigterm() as preempt:
        for step in range(1, 100):
            if step == 3 and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if preempt.should_stop():
                break
    return step, signal.getsignal(signal.SIGTERM) == before
