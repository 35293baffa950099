"""Chapter 10's kill tests: `refimpl.chaos.run_chaos` on `refimpl.train` (DDP and ``--sharded``)
and on `refimpl.demos.chaos_trainers` (a correct trainer and two broken ones).

Each function returns the rows; ``refimpl.chaos.format_table(rows)`` prints them. The runs are
sized for a notebook: 16 steps of a small MLP, a short sleep per step so a kill lands where
its line says. One trainer's four scenarios start torchrun's workers eight to ten times, each
importing torch: that, not the training, is what a run costs.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from refimpl.chaos import SCENARIOS, ChaosRow, run_chaos
from refimpl.demos.train import train_command

__all__ = ["TRAIN_ARGS", "chaos_report", "chaos_toy", "chaos_train", "toy_command"]

TRAIN_ARGS = (
    "--steps",
    "16",
    "--save-every",
    "4",
    "--seed",
    "3",
    "--ckpt-dir",
    "{out}/ckpt",
    "--final-weights",
    "{out}/w.pt",
    "--step-sleep",
    "0.05",
    "--progress",
    "never",
    "--pg-timeout",
    "30",
)
"""`refimpl.train`'s arguments in `chaos_train`: 16 steps, a checkpoint every 4."""


def chaos_train(
    *,
    sharded: bool = False,
    scenarios: Sequence[str] = SCENARIOS,
    timeout_s: float = 150.0,
    work: str | os.PathLike[str] | None = None,
    jobs: int = 1,
    extra_args: Sequence[str] = (),
) -> list[ChaosRow]:
    """The kill test on ``torchrun --nproc_per_node=2 --max-restarts=2 -m refimpl.train``.

    Kills land at rank 0's ``step 6`` line (after the step-4 checkpoint) and, for rank 0 in a
    save, at its ``step 8`` line, which `refimpl.train` prints just before saving step 8 (with
    ``--async-save``, just before staging it: the kill then lands with step 4's write done and
    step 8's starting). ``extra_args`` go to `refimpl.train` after `TRAIN_ARGS` (for example
    ``["--async-save", "--lr-schedule", "cosine"]``); ``jobs`` scenarios run side by side
    (`refimpl.chaos.run_chaos`).
    """
    flags = [*TRAIN_ARGS, *(["--sharded"] if sharded else []), *extra_args]
    cmd = train_command(flags, max_restarts=2)
    return run_chaos(
        cmd,
        kill_on=r"^\[rank0\] step 6 loss",
        save_on=r"^\[rank0\] step 8 loss",
        compare="w.pt",
        resume_on=r"\[rank0\] resumed from",
        scenarios=scenarios,
        timeout_s=timeout_s,
        work=work,
        jobs=jobs,
    )


def toy_command(variant: str = "ok", nproc: int = 2) -> list[str]:
    """``torchrun ... -m refimpl.demos.chaos_trainers --variant V --out {out}``."""
    torchrun = Path(sys.executable).with_name("torchrun")
    head = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    module = ["-m", "refimpl.demos.chaos_trainers", "--variant", variant, "--out", "{out}"]
    return [*head, "--standalone", f"--nproc_per_node={nproc}", "--max-restarts=2", *module]


def chaos_toy(
    variant: str = "ok",
    *,
    scenarios: Sequence[str] = SCENARIOS,
    timeout_s: float = 150.0,
    work: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    jobs: int = 1,
    reference: str | os.PathLike[str] | None = None,
) -> list[ChaosRow]:
    """The kill test on a `refimpl.demos.chaos_trainers` variant (``ok``, ``no-rng``,
    ``no-sampler``): kills at ``step 6``, rank 0 at ``saving step 12``; ``env`` is added to
    the command's environment; ``jobs`` scenarios run side by side. The variants differ only in
    what a resume restores, so their uninterrupted runs are the same run: one variant's
    reference (``reference``, as in `refimpl.chaos.run_chaos`) serves them all. Neither
    trainer needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``: both call
    `refimpl.launch.init_from_env`, which scopes each attempt's keys."""
    return run_chaos(
        toy_command(variant),
        kill_on=r"^step 6 loss",
        save_on=r"^saving step 12",
        compare="final.pt",
        scenarios=scenarios,
        timeout_s=timeout_s,
        work=work,
        env=env,
        jobs=jobs,
        reference=reference,
    )


def chaos_report(rows: Sequence[ChaosRow | Mapping[str, Any]], width: int = 100) -> str:
    """The kill test's rows for a page ``width`` columns wide: scenario, where the kill
    landed, restarts and the verdict on one line; the resume line and the first difference
    (wrapped) under it. The same facts as `refimpl.chaos.format_table`, whose one-line rows
    run past 100 columns once a path or a difference is long. Rows may be `ChaosRow` objects
    or the dicts ``--json`` writes."""
    out = [f"{'scenario':<16} {'kill landed at':<46} {'restarts':>8}  result"]
    for row in rows:
        r = row if isinstance(row, Mapping) else vars(row)
        landed = textwrap.shorten(r["landed"].strip(), 44, placeholder="...")
        verdict = "bit-identical" if r["equal"] else "DIFFERS"
        out.append(f"{r['scenario']:<16} {landed!r:<46} {r['restarts']:>8}  {verdict}")
        notes = [f"resumed: {(r['resume'] or '-').strip()}"]
        if not r["equal"]:
            notes.append(f"difference: {r['difference']}")
        out += [
            textwrap.fill(n, width, initial_indent=" " * 4, subsequent_indent=" " * 8)
            for n in notes
        ]
    return "\n".join(out)
