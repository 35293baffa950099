"""How `refimpl.train` is interrupted on purpose: ``--fail-at-step``'s crash.

(SIGTERM, the other interruption, is `refimpl.preemption.StopOnSigterm`.)
"""

from __future__ import annotations

import os
from collections.abc import Callable

from refimpl.atomic import atomic_write_bytes
from refimpl.train import FAULT_MARKER


def inject_fault(ckpt_dir: str, step: int, log: Callable[[str], None]) -> None:
    """Die at ``step`` unless this fault already fired; the marker makes the retry survive."""
    marker = os.path.join(ckpt_dir, FAULT_MARKER.format(step=step))
    if os.path.exists(marker):
        return
    os.makedirs(ckpt_dir, exist_ok=True)
    atomic_write_bytes(b"", marker)  # before dying: the restarted worker must not die again
    log(f"injected fault: exiting with code 1 at the start of step {step}")
    os._exit(1)  # no cleanup, no exception handlers: as abrupt as a segfault or the OOM killer
