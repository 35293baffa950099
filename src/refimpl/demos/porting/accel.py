"""Chapter 12's Accelerate trainer: `refimpl.chaos` on ``train_accelerate.py`` (Hugging Face
Accelerate's usual checkpointing style) and on its port, ``train_accelerate_refimpl.py``, and
what each resumed run trained, read from their ``--trace`` logs.

Both run under ``torchrun --nproc-per-node=2 --max-restarts=2``; ``kill-rank1`` SIGKILLs rank
1 at rank 0's ``epoch 1 step 11`` line (16 steps in 2 epochs of 8, a checkpoint every 5: the
restart resumes from step 10, two batches into the second epoch, and the next save is at step
15). ``train_accelerate.py`` lets Accelerate create the process group, so its runs get
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (chapter 10); the port calls
`refimpl.launch.init_from_env` first, which Accelerate then uses.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from refimpl.chaos import ChaosRow, run_chaos
from refimpl.demos.porting import relative_paths

__all__ = [
    "ACCELERATE",
    "Resume",
    "accelerate_command",
    "accelerate_diff",
    "chaos_accelerate",
]
__all__ += ["resume_evidence"]

HERE = Path(__file__).resolve().parent
ACCELERATE = {
    "as-is": HERE / "train_accelerate.py",
    "port": HERE / "train_accelerate_refimpl.py",
}
"""The Accelerate-style trainer and its port, by the name chapter 12 gives them
(``train_accelerate.py`` and ``train_accelerate_refimpl.py`` beside this module).

:meta hide-value:
"""

KILL_ON = r"^epoch 1 step 11 "
"""Where rank 1 is killed: rank 0's line after step 11 (saved at 5 and 10)."""


def accelerate_command(
    name: str, *, nproc: int = 2, step_sleep: float = 0.05
) -> list[str]:
    """``torchrun --standalone --nproc-per-node=N --max-restarts=2 SCRIPT --out {out} --trace
    {out}/trace``, as `refimpl.chaos` takes it; each step sleeps ``step_sleep`` (time for a
    kill to land where its line says). Raises `KeyError` for a name not in `ACCELERATE`."""
    torchrun = Path(sys.executable).with_name("torchrun")
    head = (
        [str(torchrun)]
        if torchrun.exists()
        else [sys.executable, "-m", "torch.distributed.run"]
    )
    return [
        *head,
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=2",
        str(ACCELERATE[name]),
        "--out",
        "{out}",
        "--trace",
        "{out}/trace",
        "--step-sleep",
        str(step_sleep),
    ]


def chaos_accelerate(
    work: str | os.PathLike[str],
    names: Sequence[str] = tuple(ACCELERATE),
    *,
    timeout_s: float = 180.0,
) -> dict[str, ChaosRow]:
    """The kill test (``kill-rank1`` at `KILL_ON`) on each script of ``names``; its runs stay
    in ``work/NAME`` (``reference`` and ``kill-rank1``), and its row shows paths relative
    to ``work`` (`refimpl.demos.porting.relative_paths`). Raises `refimpl.chaos.ChaosError`
    when a run cannot be judged."""
    rows = {}
    for name in names:
        # a tiny model: one thread is faster on a busy machine
        env = {"OMP_NUM_THREADS": "1"}
        if name == "as-is":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        (row,) = run_chaos(
            accelerate_command(name),
            kill_on=KILL_ON,
            compare="final.pt",
            resume_on=r"^Resumed from checkpoint",
            scenarios=["kill-rank1"],
            timeout_s=timeout_s,
            work=Path(work) / name,
            env=env,
        )
        rows[name] = relative_paths(row, work)
    return rows


@dataclass
class Resume:
    """One rank's steps after its last resume, against the uninterrupted run's same steps:
    where it resumed; whether torch's global RNG at the top of the first resumed step was the
    reference's; how many steps trained the reference's batch; for each other batch, the step
    at which the reference trained it (None: never); and whether the shuffle's state
    (``train_accelerate.py``'s third trace field) matched at every resumed step."""

    rank: int
    resumed_at: int
    rng_equal: bool
    same_batch: int
    steps: int
    batch_from: list[int | None]
    shuffle_equal: bool


def _trace(path: Path) -> list[list[str]]:
    return [ln.split() for ln in path.read_text().splitlines() if len(ln.split()) == 4]


def resume_evidence(
    run_dir: str | os.PathLike[str],
    reference_dir: str | os.PathLike[str],
    nproc: int = 2,
) -> list[Resume]:
    """Compare each rank's ``trace.rankR`` after its last resume with the reference's. Raises
    `ValueError` when a rank's trace shows no resume (the step number never goes back)."""
    out = []
    for rank in range(nproc):
        ref = {
            int(s): (rng, shuffle, ids)
            for s, rng, shuffle, ids in _trace(
                Path(reference_dir) / f"trace.rank{rank}"
            )
        }
        when = {ids: s for s, (_, _, ids) in sorted(ref.items(), reverse=True)}
        lines = _trace(Path(run_dir) / f"trace.rank{rank}")
        starts = [
            i for i in range(1, len(lines)) if int(lines[i][0]) <= int(lines[i - 1][0])
        ]
        if not starts:
            raise ValueError(f"{run_dir}/trace.rank{rank}: no resume in it")
        after = lines[starts[-1] :]
        first = int(after[0][0])
        same = [ref[int(s)][2] == ids for s, _, _, ids in after]
        out.append(
            Resume(
                rank,
                first,
                after[0][1] == ref[first][0],
                sum(same),
                len(after),
                [
                    when.get(ids)
                    for (_, _, _, ids), ok in zip(after, same, strict=True)
                    if not ok
                ],
                all(ref[int(s)][1] == sh for s, _, sh, _ in after),
            )
        )
    return out


def accelerate_diff(context: int = 1) -> tuple[list[str], int, int]:
    """The port as unified-diff hunks of ``train_accelerate.py`` to
    ``train_accelerate_refimpl.py``, and the lines added and removed."""
    a, b = (ACCELERATE[n].read_text().splitlines() for n in ("as-is", "port"))
    lines = list(
        difflib.unified_diff(
            a,
            b,
            ACCELERATE["as-is"].name,
            ACCELERATE["port"].name,
            n=context,
            lineterm="",
        )
    )
    added = sum(ln.startswith("+") and not ln.startswith("+++") for ln in lines)
    removed = sum(ln.startswith("-") and not ln.startswith("---") for ln in lines)
    hunks: list[str] = []
    for ln in lines[2:]:
        if ln.startswith("@@"):
            hunks.append(ln)
        else:
            hunks[-1] += "\n" + ln
    return hunks, added, removed
