"""Chapter 12: port a nanoGPT-style script to refimpl, and kill-test both versions.

The two scripts are files a reader can open and diff: ``train_gpt.py`` (the original style:
random offsets from an unsaved RNG, rank 0's ``torch.save`` of ``ckpt.pt`` in place) and
``train_gpt_refimpl.py`` (the port), both training `refimpl.demos.porting.model.GPT` on
characters of two sonnets that `prepare_data` writes as nanoGPT's ``train.bin``/``val.bin``.

What the chapter measures with them:

- `chaos_scripts`: ``refimpl.chaos`` on each script under ``torchrun --max-restarts=2``;
  `draws_after_resume` reads the runs' batch logs (which batch each rank trained at each
  iteration) and `differing_tensors` counts the tensors of ``final.pt`` that differ;
- `rng_capture_points`: on 2 spawned ranks, where and whose RNG a checkpoint must hold (the
  script's loop in miniature: rank 0 evaluates with random batches, then saves);
- `torn_save`: the next save dies mid-write (a real kill, by the file-size limit) under each
  script's way of saving, and what the next start can load;
- `script_diff`: the port as a unified diff, and its size.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from refimpl._compare import first_difference, load_flat
from refimpl.chaos import ChaosRow, run_chaos

__all__ = [
    "SCRIPTS",
    "TEXT",
    "Draws",
    "chaos_scripts",
    "differing_tensors",
    "draws_after_resume",
]
__all__ += [
    "prepare_data",
    "relative_paths",
    "rng_capture_points",
    "script_command",
    "script_diff",
    "torn_save",
]

HERE = Path(__file__).resolve().parent
SCRIPTS = {"original": HERE / "train_gpt.py", "port": HERE / "train_gpt_refimpl.py"}
"""The two scripts chapter 12 compares, by the name it gives them (``train_gpt.py`` and
``train_gpt_refimpl.py`` beside this module).

:meta hide-value:
"""

TEXT = """\
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
Let me not to the marriage of true minds
Admit impediments. Love is not love
Which alters when it alteration finds,
Or bends with the remover to remove.
O no! it is an ever-fixed mark
That looks on tempests and is never shaken;
It is the star to every wand'ring bark,
Whose worth's unknown, although his height be taken.
Love's not Time's fool, though rosy lips and cheeks
Within his bending sickle's compass come;
Love alters not with his brief hours and weeks,
But bears it out even to the edge of doom.
If this be error and upon me prov'd,
I never writ, nor no man ever lov'd.
"""
"""Shakespeare's sonnets 18 and 116 (public domain), about 1,200 characters of text."""


def prepare_data(data_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Write ``train.bin``, ``val.bin`` (uint16 character ids, a 90/10 split) and ``meta.json``
    (``vocab_size``) as nanoGPT's ``shakespeare_char/prepare.py`` does; return the sizes."""
    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(TEXT))
    ids = np.array([chars.index(c) for c in TEXT], dtype=np.uint16)
    n = int(0.9 * len(ids))
    ids[:n].tofile(out / "train.bin")
    ids[n:].tofile(out / "val.bin")
    (out / "meta.json").write_text(json.dumps({"vocab_size": len(chars)}))
    return {"vocab_size": len(chars), "train": n, "val": len(ids) - n}


def script_command(
    name: str,
    data_dir: str | os.PathLike[str],
    *,
    nproc: int = 2,
    max_restarts: int = 2,
    step_sleep: float = 0.05,
) -> list[str]:
    """``torchrun --standalone ... SCRIPT --out_dir={out} --data_dir=DATA ...``, as
    `refimpl.chaos` takes it: each run writes under its own ``{out}``, logs the batch each
    rank trains to ``{out}/draws.rankR``, and sleeps ``step_sleep`` a step (time for a kill
    to land at the line it was aimed at)."""
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
        f"--max-restarts={max_restarts}",
        str(SCRIPTS[name]),
        "--out_dir={out}",
        f"--data_dir={data_dir}",
        f"--step_sleep={step_sleep}",
        "--draws_log={out}/draws",
    ]


def relative_paths(row: ChaosRow, root: str | os.PathLike[str]) -> ChaosRow:
    """``row`` with ``root/`` taken off every path its text shows (the resume line, the
    difference, the detail), so a page shows ``original/kill-rank1``, not where this
    machine keeps its temporary files; ``row.log`` stays a usable path. Never raises."""
    prefix = f"{os.fspath(root).rstrip(os.sep)}{os.sep}"

    def short(text: str | None) -> str | None:
        return None if text is None else text.replace(prefix, "")

    return replace(
        row,
        resume=short(row.resume),
        difference=short(row.difference),
        detail=short(row.detail),
    )


KILL_ON = r"^iter 6: loss"
"""Where both scripts are killed: rank 0's log line after iteration 6 (saved at 4 and 8)."""
SAVE_ON = r"^step 8: train loss"
"""Where rank 0 is killed in its save: the evaluation line printed just before saving step 8."""


def chaos_scripts(
    data_dir: str | os.PathLike[str],
    work: str | os.PathLike[str],
    *,
    names: Sequence[str] = tuple(SCRIPTS),
    scenarios: Sequence[str] = ("kill-rank1", "kill-rank0-save"),
    timeout_s: float = 120.0,
) -> dict[str, list[ChaosRow]]:
    """`refimpl.chaos.run_chaos` on the scripts ``names`` (default both); the runs stay in
    ``work/NAME/SCENARIO``. Kills land at `KILL_ON` and, for rank 0 in a save, `SAVE_ON`.
    The rows show paths relative to ``work`` (`relative_paths`).

    The original calls ``init_process_group`` itself, so it runs with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (chapter 10: a restart on torchrun's shared store
    can otherwise fail before the script gets to resume, and this test is about the resume).
    """
    rows = {}
    for name in names:
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if name == "original" else {}
        found = run_chaos(
            script_command(name, data_dir),
            kill_on=KILL_ON,
            save_on=SAVE_ON,
            compare="final.pt",
            resume_on=r"^Resuming training",
            scenarios=scenarios,
            timeout_s=timeout_s,
            work=Path(work) / name,
            env=env,
        )
        rows[name] = [relative_paths(row, work) for row in found]
    return rows


@dataclass
class Draws:
    """One rank's batches after its last resume, against the uninterrupted run's: where it
    resumed, how many iterations it trained from there, how many of those batches differ,
    and how many of the differing ones the reference had trained at an *earlier* iteration
    (replayed), with the lag when it is the same for all (``iteration - reference's``)."""

    rank: int
    resumed_at: int | None
    trained: int
    differ: int
    replayed: int
    lag: int | None


def _read_draws(path: Path) -> list[tuple[int, str]]:
    out = []
    for line in path.read_text().splitlines():
        # a torn last line is skipped
        if m := re.fullmatch(r"(\d+) ([0-9a-f]{8})", line):
            out.append((int(m.group(1)), m.group(2)))
    return out


def draws_after_resume(
    run_dir: str | os.PathLike[str],
    reference_dir: str | os.PathLike[str],
    nproc: int = 2,
) -> list[Draws]:
    """Compare each rank's ``draws.rankR`` log after the last resume with the reference's."""
    report = []
    for rank in range(nproc):
        ref = dict(_read_draws(Path(reference_dir) / f"draws.rank{rank}"))
        first_at = {digest: it for it, digest in sorted(ref.items(), reverse=True)}
        lines = _read_draws(Path(run_dir) / f"draws.rank{rank}")
        starts = [i for i in range(1, len(lines)) if lines[i][0] <= lines[i - 1][0]]
        after = lines[starts[-1] :] if starts else []
        differ = [(it, d) for it, d in after if ref.get(it) != d]
        earlier = [it - first_at[d] for it, d in differ if first_at.get(d, it) < it]
        lag = earlier[0] if len(set(earlier)) == 1 else None
        start = after[0][0] if after else None
        report.append(Draws(rank, start, len(after), len(differ), len(earlier), lag))
    return report


def differing_tensors(
    run_dir: str | os.PathLike[str],
    reference_dir: str | os.PathLike[str],
    name: str = "final.pt",
) -> tuple[int, int]:
    """(tensors that differ, tensors in all) between two runs' ``name`` (weights-only)."""
    ref, got = load_flat(Path(reference_dir) / name), load_flat(Path(run_dir) / name)
    tensors = [k for k, v in ref.items() if isinstance(v, torch.Tensor)]
    differ = sum(
        first_difference({k: ref[k]}, {k: got.get(k)}) is not None for k in tensors
    )
    return differ, len(tensors)


# --- where, and whose, RNG a checkpoint must hold: the script's loop in miniature ---------------

CAPTURE_VARIANTS = {
    "nothing": "no RNG saved (train_gpt.py)",
    "rank0": "rank 0's RNG only, before its eval, loaded by every rank",
    "after-eval": "every rank's RNG, captured after rank 0's eval (where it saves)",
    "before-eval": "every rank's RNG, captured before rank 0's eval (the port)",
}
"""The ways `rng_capture_points` saves and restores the RNG, with how the chapter names them."""


def _loop(
    rank: int,
    start: int,
    stop: int,
    at: int | None,
    variant: str,
    ckpt: str,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
) -> list[list[float]]:
    """Iterations ``start..stop-1`` of the script's loop: rank 0 evaluates every 4 (random
    batches), then each rank draws its batch offsets and dropout's numbers; a checkpoint is
    written at iteration ``at``. Returns each iteration's draws."""
    from refimpl.checkpoint import save_checkpoint
    from refimpl.trainstate import capture_every_rank

    draws = []
    for it in range(start, stop):
        state, own = None, None
        if it == at and variant == "before-eval":
            state = capture_every_rank(model, opt, step=it)
        if it == at and variant == "rank0":
            own = torch.get_rng_state()  # what rank 0 can see: its own stream
        if it % 4 == 0 and rank == 0:
            torch.randint(1000, (2, 4))  # estimate_loss: random evaluation batches
        if it == at and variant == "after-eval":  # every rank, after rank 0's eval
            state = capture_every_rank(model, opt, step=it)
        if it == at and rank == 0:
            if state is not None:
                save_checkpoint(ckpt, state, it)
            elif own is not None:
                torch.save({"rng": own, "iter_num": it}, f"{ckpt}.pt")
        if it == at:
            dist.barrier()  # the file is there before anyone reads it
        draws.append(torch.randint(1000, (4,)).tolist() + torch.rand(2).tolist())
    return draws


def capture_point_worker(
    ckpt_root: str, iters: int = 10, at: int = 4
) -> dict[str, Any]:
    """Spawned rank: the loop uninterrupted, then for each variant a run to ``at`` (it saves
    there) and a restart that resumes at ``at`` as that variant restores; the draws of each."""
    from refimpl.trainstate import resume_every_rank

    rank = dist.get_rank()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1337 + rank)
    reference = _loop(rank, 0, iters, None, "", "", model, opt)
    out: dict[str, Any] = {"reference": reference}
    for variant in CAPTURE_VARIANTS:
        ckpt = os.path.join(ckpt_root, variant)
        torch.manual_seed(1337 + rank)
        _loop(rank, 0, at + 1, at, variant, ckpt, model, opt)  # killed after `at`
        # the restart: a fresh process seeds as the script does
        torch.manual_seed(1337 + rank)
        if variant == "rank0":
            torch.set_rng_state(torch.load(f"{ckpt}.pt", weights_only=True)["rng"])
        elif variant != "nothing":
            resume_every_rank(ckpt, model, opt)
        out[variant] = _loop(rank, at, iters, None, "", "", model, opt)
    return out


def rng_capture_points(iters: int = 10, at: int = 4) -> list[dict[str, Any]]:
    """One row per variant of `CAPTURE_VARIANTS`: per rank, how many of the iterations after
    the resume at ``at`` drew what the uninterrupted run drew (batch offsets and dropout's
    numbers). Runs on 2 ranks (`refimpl.launch.spawn`)."""
    from refimpl.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        ranks = spawn(capture_point_worker, 2, tmp, iters, at, timeout_s=60)
    rows = []
    for variant, label in CAPTURE_VARIANTS.items():
        same = [
            sum(a == b for a, b in zip(r[variant], r["reference"][at:], strict=True))
            for r in ranks
        ]
        rows.append(
            {
                "variant": variant,
                "how": label,
                "iterations": iters - at,
                "rank0": same[0],
                "rank1": same[1],
            }
        )
    return rows


# --- a save that dies mid-write -------------------------------------------------------------

_TORN_CHILD = """
import os, resource, signal, sys, torch
kind, src, dst, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if kind == "original":
    state = torch.load(src, weights_only=True)
else:
    from refimpl.checkpoint import load_latest, save_checkpoint
    step, state = load_latest(src)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel's default kills
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # no file may grow past `limit`
if kind == "original":
    torch.save(state, dst)  # over the only checkpoint, in place, as train_gpt.py does
else:
    save_checkpoint(dst, state, step + 4)  # the next step, as train_gpt_refimpl.py does
print("the save returned")  # never reached
"""


def torn_save(
    kind: str, target: str | os.PathLike[str], limit_bytes: int
) -> dict[str, Any]:
    """The next save of ``kind`` ("original": ``torch.save`` over ``target``, a ``ckpt.pt``;
    "port": ``save_checkpoint`` of the next step into ``target``, a checkpoint directory) in
    a child process that the kernel kills (SIGXFSZ) as a file passes ``limit_bytes``, like a
    SIGKILL at that byte. Returns how the child ended and what a restart can load."""
    target = Path(target)
    cmd = [
        sys.executable,
        "-c",
        _TORN_CHILD,
        kind,
        str(target),
        str(target),
        str(limit_bytes),
    ]
    child = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    ended = (
        f"killed by signal {-child.returncode}"
        if child.returncode < 0
        else f"exit code {child.returncode}"
    )
    result: dict[str, Any] = {"child": ended}
    if kind == "original":
        result["bytes"] = target.stat().st_size
        try:
            torch.load(target, weights_only=True)
            result["load"] = "loads"
        except Exception as exc:  # what the restarted script's torch.load raises
            result["load"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    else:
        from refimpl.checkpoint import list_checkpoints, load_latest

        result["steps"] = [d.name for _, d in list_checkpoints(target)]
        found = load_latest(target)
        result["load"] = f"step {found[0]}" if found is not None else "nothing"
    return result


def script_diff(context: int = 1) -> tuple[list[str], int, int]:
    """The port as unified-diff hunks of ``train_gpt.py`` to ``train_gpt_refimpl.py``, and
    the lines added and removed."""
    a, b = (SCRIPTS[n].read_text().splitlines() for n in ("original", "port"))
    lines = list(
        difflib.unified_diff(
            a, b, "train_gpt.py", "train_gpt_refimpl.py", n=context, lineterm=""
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
