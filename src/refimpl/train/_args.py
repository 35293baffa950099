"""The command line of ``python -m refimpl.train`` (chapter 10): every flag, checked on parsing.

`refimpl.train.parse_args` is this module's `parse_args`; it lives apart so that the trainer's
module holds the training and nothing but it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from refimpl._system.argtypes import float_range, int_range, nonempty
from refimpl.train._watchdog import unavailable as watchdog_unavailable

__all__ = ["DESCRIPTION", "parse_args"]

DESCRIPTION = (
    "Chapter 10: a trainer that can be killed at any moment and finishes as if it never was."
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of ``python -m refimpl.train`` (see ``--help``); exits 2 naming the
    flag on a bad value. `main` reads it as one typed ``TrainConfig`` (``train/_config.py``)."""
    p = argparse.ArgumentParser(prog="python -m refimpl.train", description=DESCRIPTION)
    # Every value is checked here (exit 2 naming the flag), not where it is first used: a bad
    # --keep-last used to fail at the first save on every rank, and on every restart.
    count, positive, seconds = int_range(0), int_range(1), float_range(0, low_open=True)
    p.add_argument("--steps", type=count, default=20, help="optimizer steps in all")
    p.add_argument("--save-every", type=positive, default=5, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=positive, default=3, help="committed checkpoints to keep")
    p.add_argument("--ckpt-dir", type=nonempty, default="ckpt", help="where step_N checkpoints go")
    p.add_argument(
        "--final-weights", type=nonempty, default=None, help="write the weights here at the end"
    )
    p.add_argument(
        "--seed",
        type=int_range(0, 2**32 - 1),
        default=0,
        help="weights, data, sample order, dropout",
    )
    p.add_argument("--batch-size", type=positive, default=8, help="samples per rank per step")
    p.add_argument("--samples", type=positive, default=256, help="size of the synthetic dataset")
    p.add_argument(
        "--lr", type=float_range(0, low_open=True), default=1e-2, help="AdamW learning rate"
    )
    p.add_argument(
        "--reset-lr",
        action="store_true",
        help="on resume, train on at --lr instead of the checkpoint's rate",
    )
    p.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="after warmup: constant, or cosine to 0.1 x --lr at --steps",
    )
    p.add_argument("--warmup-steps", type=count, default=0, help="linear LR warmup steps")
    p.add_argument(
        "--dropout", type=float_range(0, 1), default=0.1, help="makes the RNG part of the state"
    )
    p.add_argument("--pg-timeout", type=seconds, default=60.0, help="collective timeout, seconds")
    p.add_argument("--save-timeout", type=seconds, default=600.0, help="wait for rank 0's save")
    p.add_argument(
        "--log-every", type=positive, default=1, help="rank 0 logs the loss every N steps"
    )
    p.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="tqdm bar on rank 0 (auto: when stderr is a terminal)",
    )
    p.add_argument(
        "--sharded",
        action="store_true",
        help="FSDP2 and sharded DCP checkpoints: resume at any world size",
    )
    p.add_argument(
        "--async-save",
        action="store_true",
        help="write each checkpoint during the next steps (rank 0's file, or "
        "every rank's shard with --sharded)",
    )
    p.add_argument(
        "--step-timeout",
        type=seconds,
        default=None,
        help="kill a worker stuck in a step or a save this long (torchrun's file "
        "timer: TORCHELASTIC_ENABLE_FILE_TIMER=1)",
    )
    fault = p.add_argument_group("fault injection and debugging (chapter 10's demos)")
    fault.add_argument(
        "--fail-at-step",
        type=positive,
        default=None,
        help="one rank dies (os._exit(1)) at the start of step S, once",
    )
    fault.add_argument(
        "--fail-rank", type=int_range(-1), default=-1, help="which rank (-1: the last)"
    )
    fault.add_argument(
        "--hang-in-save-at-step",
        type=positive,
        default=None,
        help="rank 0's save of step S blocks forever, once",
    )
    fault.add_argument(
        "--log-times",
        action="store_true",
        help="prefix each line with @UNIX_TIME; log start-up timings",
    )
    fault.add_argument(
        "--step-sleep",
        type=float_range(0),
        default=0.0,
        help="sleep after each step (time to send a signal)",
    )
    fault.add_argument(
        "--sample-log",
        type=nonempty,
        default=None,
        help="append each step's sample indices to PATH.rankR",
    )
    fault.add_argument(
        "--no-restore",
        action="append",
        default=[],
        choices=("rng", "data", "optimizer"),
        help="resume WITHOUT this part of the state: what breaks",
    )
    args = p.parse_args(argv)
    if args.sharded and "rng" in args.no_restore:
        p.error("--sharded saves no RNG state (each step re-seeds dropout): nothing to leave out")
    if args.step_timeout is not None and (why := watchdog_unavailable()):
        p.error(why)
    return args
