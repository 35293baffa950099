"""The trainer's configuration: every flag of ``python -m refimpl.train``, parsed once.

`refimpl.train.parse_args` checks the command line; `TrainConfig.from_namespace` turns its
result into the one typed object the loop and the checkpoint backends read.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """One run's settings, each the flag of the same name (``--save-every`` is `save_every`;
    ``python -m refimpl.train --help`` says what each does)."""

    steps: int
    save_every: int
    keep_last: int
    ckpt_dir: str
    final_weights: str | None
    seed: int
    batch_size: int
    samples: int
    lr: float
    reset_lr: bool
    lr_schedule: str
    warmup_steps: int
    dropout: float
    pg_timeout: float
    save_timeout: float
    log_every: int
    progress: str
    sharded: bool
    async_save: bool
    step_timeout: float | None
    # fault injection and debugging (chapter 10's demos: `refimpl.train._hooks`)
    fail_at_step: int | None
    fail_rank: int
    hang_in_save_at_step: int | None
    log_times: bool
    step_sleep: float
    sample_log: str | None
    no_restore: tuple[str, ...]

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> TrainConfig:
        """The config of `refimpl.train.parse_args`'s result; raises ``ValueError`` naming the
        flags when its names and the fields differ (a flag added to one and not the other)."""
        names = {f.name for f in dataclasses.fields(cls)}
        given = set(vars(args))
        if given != names:
            raise ValueError(
                f"refimpl.train: flags without a TrainConfig field: {sorted(given - names)}; "
                f"fields without a flag: {sorted(names - given)}"
            )
        values = {name: getattr(args, name) for name in names}
        values["no_restore"] = tuple(values["no_restore"])
        return cls(**values)
