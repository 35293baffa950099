"""Chapter 12's five traps: `refimpl.chaos` on ``train_mini.py`` (a MiniMind-style trainer),
once with its exact resume and once per ``--trap``, each breaking one thing a resume needs.

Every variant trains the same run when nothing kills it (the traps are all in what a
checkpoint holds and how a start restores it), so one uninterrupted run is the reference of
all of them. The scenario is ``kill-job``: one process (no torchrun; the traps are per process),
SIGKILLed at the line of epoch 2's batch 9, then started again. Both the exact trainer's save
(after batch 7, the optimizer step of batches 6 and 7) and the ``accum`` trap's (after batch 8,
half way through the window of batches 8 and 9) come before that line, and the exact
trainer's next save is six batches later: the kill always resumes from the same step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from refimpl.chaos import ChaosRow, run_chaos
from refimpl.demos.porting import relative_paths, train_mini

__all__ = [
    "MINI",
    "TRAPS",
    "chaos_traps",
    "first_line_after_resume",
    "fp16_round_trip",
]
__all__ += ["mini_command"]

TRAPS = train_mini.TRAPS
"""The traps ``train_mini.py --trap`` can switch on, one at a time."""

MINI = Path(__file__).resolve().parent / "train_mini.py"
"""The MiniMind-style trainer chapter 12 kill-tests (``train_mini.py`` beside this module).

:meta hide-value:
"""

KILL_ON = r"^Epoch:\[2/2\]\(9/"
"""Where every run is killed: the line of epoch 2's batch 9 (0-based)."""

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""A model this small runs faster on one intra-op thread than on threads that wait for each
other on a busy machine; the results do not depend on it."""


def mini_command(trap: str | None = None, *, step_sleep: float = 0.05) -> list[str]:
    """``python train_mini.py --out {out} [--trap TRAP]``, as `refimpl.chaos` takes it; each
    batch sleeps ``step_sleep`` (time for a kill to land where its line says). Raises
    `ValueError` for a trap that is not one of `TRAPS`."""
    if trap is not None and trap not in TRAPS:
        raise ValueError(f"unknown trap {trap!r}: one of {', '.join(TRAPS)}, or None")
    flags = ["--trap", trap] if trap is not None else []
    return [
        sys.executable,
        str(MINI),
        "--out",
        "{out}",
        "--step-sleep",
        str(step_sleep),
        *flags,
    ]


def chaos_traps(
    work: str | os.PathLike[str],
    traps: Sequence[str | None] = (None, *TRAPS),
    *,
    timeout_s: float = 120.0,
) -> dict[str | None, ChaosRow]:
    """The kill test (``kill-job`` at `KILL_ON`) on each variant of ``traps`` (None: the exact
    resume); one row each. The reference runs once, into ``work/reference``, unless it is
    already there; each variant's runs go to ``work/TRAP`` (``work/exact`` for None), which
    must not exist yet; the rows show paths relative to ``work``. Raises `refimpl.chaos.ChaosError` when a run cannot be judged."""
    base = Path(work)
    reference = base / "reference"
    if not (reference / "reference" / "final.pt").is_file():
        run_chaos(
            mini_command(step_sleep=0.0),  # never killed: no time to leave for a kill
            kill_on=KILL_ON,
            compare="final.pt",
            scenarios=[],
            timeout_s=timeout_s,
            work=reference,
            env=ONE_THREAD,
        )
    rows = {}
    for trap in traps:
        (row,) = run_chaos(
            mini_command(trap),
            kill_on=KILL_ON,
            compare="final.pt",
            scenarios=["kill-job"],
            timeout_s=timeout_s,
            work=base / (trap or "exact"),
            env=ONE_THREAD,
            reference=reference / "reference",
        )
        rows[trap] = relative_paths(row, base)
    return rows


def fp16_round_trip(ckpt: str | os.PathLike[str]) -> dict[str, float]:
    """For each weight of the fp32 checkpoint ``ckpt`` (``train_mini.py``'s ``ckpt.pth``),
    the largest ``|w - float(half(w))|``: what saving it as ``model.half()`` and loading it
    back into the fp32 model changes, before a single step of the resumed run."""
    model = torch.load(ckpt, map_location="cpu", weights_only=False)["model"]
    return {k: float((v - v.half().float()).abs().max()) for k, v in model.items()}


def first_line_after_resume(row: ChaosRow) -> str:
    """The first ``Epoch:`` line the restarted run of ``row`` printed after its resume line
    (from the run's kept log, ``WORK/kill-job.logs/output-2.log``). Raises `ValueError` when
    the restart printed no resume line or no batch after it."""
    if row.log is None:
        raise ValueError(f"scenario {row.scenario}: no kept logs to read")
    lines = (Path(row.log) / "output-2.log").read_text().splitlines()
    after = [i for i, ln in enumerate(lines) if ln.startswith("resuming from")]
    for line in lines[after[0] + 1 :] if after else []:
        if line.startswith("Epoch:"):
            return line
    raise ValueError(f"{row.log}/output-2.log: no batch after a resume line")
