"""A training loop under `StopOnSigterm`, for tests/test_preemption.py to SIGTERM.

``python preemption_script.py CKPT_DIR [--no-guard] [--again]``: steps of about 0.3 s, each
printing ``start N`` and ``done N``; a checkpoint every 1000 steps (so, in the test, only the
one the signal asks for). With ``--no-guard`` the loop runs without `StopOnSigterm`: Python's
default. With ``--again`` the process sends itself a second SIGTERM in the middle of the step
once the first has been received (two sent at once from outside may arrive as one: the kernel
does not queue a signal already pending).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import torch

from refimpl.checkpoint import save_checkpoint
from refimpl.preemption import StopOnSigterm


def main(ckpt_dir: str, guard: bool, again: bool) -> int:
    total = torch.zeros(1)
    preempt = StopOnSigterm()
    with preempt if guard else contextlib.nullcontext():
        for step in range(1, 10_000):
            print(f"start {step}", flush=True)
            for _ in range(6):  # the step's work, in pieces: a signal lands in the middle
                time.sleep(0.05)
                if again and preempt.received == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
            total += step
            print(f"done {step}", flush=True)
            stop = preempt.should_stop()
            if step % 1000 == 0 or stop:
                save_checkpoint(ckpt_dir, {"total": total, "step": step}, step)
            if stop:
                print(f"stopped after step {step}, saved; {preempt.received} SIGTERM", flush=True)
                return 0
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--no-guard" not in sys.argv, "--again" in sys.argv))
