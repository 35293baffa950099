"""Chapter 10's fault injection and debugging flags, kept out of the training loop.

The loop calls `Hooks` at four points of a step (its start, the batch drawn, the start of a
save, its end); each does nothing unless its flag was given: ``--fail-at-step`` (one rank
exits 1, once), ``--sample-log`` (each step's sample indices), ``--hang-in-save-at-step``
(rank 0's save blocks, once: `refimpl.train._watchdog.hang_once`) and ``--step-sleep``.
SIGTERM, the other interruption, is `refimpl.preemption.StopOnSigterm`, in the loop itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from refimpl.atomic import atomic_write_bytes
from refimpl.train import FAULT_MARKER
from refimpl.train._config import TrainConfig
from refimpl.train._watchdog import hang_once


class Hooks:
    """The fault and debugging flags of ``config`` for this rank of a world of ``world``.

    Raises ``ValueError`` naming the rank when ``--fail-rank`` is not a rank of this world
    (known only once the process group exists, so not at parsing)."""

    def __init__(
        self, config: TrainConfig, rank: int, world: int, log: Callable[[str], None]
    ) -> None:
        if config.fail_at_step is not None and config.fail_rank >= world:
            raise ValueError(
                f"rank {rank}: --fail-rank {config.fail_rank} is not a rank of this "
                f"world of {world}: pass 0..{world - 1}, or -1 for the last"
            )
        self._config, self._rank, self._log = config, rank, log
        self._fails = config.fail_at_step is not None and rank == config.fail_rank % world

    def step_start(self, step: int) -> None:
        """``--fail-at-step``: die at the start of ``step``, once."""
        if self._fails and self._config.fail_at_step == step:
            inject_fault(self._config.ckpt_dir, step, self._log)

    def batch(self, step: int, epoch: int, batch: Sequence[int]) -> None:
        """``--sample-log``: step, epoch, indices; for checking none is lost or repeated."""
        if self._config.sample_log:
            with open(f"{self._config.sample_log}.rank{self._rank}", "a") as f:
                f.write(f"{step} {epoch} {' '.join(map(str, batch))}\n")

    def save_start(self, step: int) -> None:
        """``--hang-in-save-at-step``: rank 0's save of ``step`` blocks, once."""
        if self._config.hang_in_save_at_step == step and self._rank == 0:
            hang_once(self._config.ckpt_dir, step, self._log)

    def step_end(self) -> None:
        """``--step-sleep``: time to send a signal between steps."""
        time.sleep(self._config.step_sleep)


def inject_fault(ckpt_dir: str, step: int, log: Callable[[str], None]) -> None:
    """Die at ``step`` unless this fault already fired; the marker makes the retry survive."""
    marker = os.path.join(ckpt_dir, FAULT_MARKER.format(step=step))
    if os.path.exists(marker):
        return
    os.makedirs(ckpt_dir, exist_ok=True)
    atomic_write_bytes(b"", marker)  # before dying: the restarted worker must not die again
    log(f"injected fault: exiting with code 1 at the start of step {step}")
    os._exit(1)  # no cleanup, no exception handlers: as abrupt as a segfault or the OOM killer
