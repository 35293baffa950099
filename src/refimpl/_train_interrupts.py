"""How `refimpl.train` is interrupted: SIGTERM as a flag, and ``--fail-at-step``'s crash."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

from refimpl.atomic import atomic_write_bytes

FAULT_MARKER = "fault_injected_at_step_{step}"
"""Name of the file `--fail-at-step` leaves in the checkpoint directory: the crash fires once."""


class StopOnSigterm:
    """Turn SIGTERM into a flag the training loop reads between steps.

    The handler only sets the flag: Python runs it between bytecodes, possibly in the middle
    of a print or a save, so doing the work there would be unsafe. The previous handler is put
    back on exit, since `main` also runs inside other programs (`refimpl.launch.spawn`).
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def __enter__(self) -> StopOnSigterm:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def inject_fault(ckpt_dir: str, step: int, log: Callable[[str], None]) -> None:
    """Die at ``step`` unless this fault already fired; the marker makes the retry survive."""
    marker = os.path.join(ckpt_dir, FAULT_MARKER.format(step=step))
    if os.path.exists(marker):
        return
    os.makedirs(ckpt_dir, exist_ok=True)
    atomic_write_bytes(b"", marker)  # before dying: the restarted worker must not die again
    log(f"injected fault: exiting with code 1 at the start of step {step}")
    os._exit(1)  # no cleanup, no exception handlers: as abrupt as a segfault or the OOM killer
