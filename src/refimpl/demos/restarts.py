"""Restart runs: the README's command five times, a stuck save (chapter 10), a restart's cost (11).

`readme_runs` runs the command the README prints (``--fail-at-step 17``, torchrun's shared store,
no variable set) several times and compares each run's final weights with an uninterrupted
run's. `stuck_save` runs it with a save that blocks forever and ``--step-timeout``: torchrun's
file timer kills the stuck worker and the job finishes anyway. `restart_cost` SIGKILLs one
worker N times and splits the time from each kill to the first resumed step (R) into its parts,
from the trainer's ``--log-times`` lines and torchrun's own log (``LOGGING=INFO``).
"""

from __future__ import annotations

import datetime
import os
import re
import statistics
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from refimpl.demos.train import TrainRun, run_train, same_weights

__all__ = ["PARTS", "readme_runs", "restart_cost", "split_restarts", "stuck_save"]

README_ARGS = [
    "--steps",
    "30",
    "--save-every",
    "5",
    "--seed",
    "3",
    "--ckpt-dir",
    "ck",
    "--final-weights",
    "w.pt",
]
PARTS = ("detect", "stop+rendezvous", "spawn", "imports", "group init", "load", "first step")
"""The parts of R, in order. kill -> agent logs the failure -> rendezvous done -> process
created -> torch imported -> process group ready -> checkpoint loaded -> first step logged."""
_AGENT = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) .*\] (.*)$")
_STAMP = re.compile(r"^\[rank(\d+)\] @([\d.]+) (.*)$")


def _run_in(workdir: Path, name: str, args: Sequence[str], **kwargs: Any) -> TrainRun:
    (workdir / name).mkdir(parents=True, exist_ok=True)
    return run_train(args, cwd=workdir / name, **kwargs)


def _reference(work: Path) -> TrainRun | None:
    """The uninterrupted run of the README's command in ``work/reference``; None when an
    earlier call left its weights there (`readme_runs` then `stuck_save` in one directory
    run it once)."""
    if (work / "reference" / "w.pt").exists():
        return None
    ref = _run_in(work, "reference", README_ARGS, timeout_s=120)
    if ref.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{ref.stderr[-2000:]}")
    return ref


def readme_runs(workdir: str | os.PathLike[str], runs: int = 5) -> list[dict[str, Any]]:
    """The README's kill-and-restart command ``runs`` times in a row: seconds, exit code,
    bit-identical to the uninterrupted run in ``workdir/reference`` (made beside the first
    killed run, unless already there: the two are independent, and each waits on torchrun's
    restarts and rendezvous, not only on the CPU)."""
    work = Path(workdir)
    killed: list[tuple[int | None, float]] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        reference = pool.submit(_reference, work)
        for i in range(runs):
            try:
                run = _run_in(
                    work, f"run{i}", [*README_ARGS, "--fail-at-step", "17"], timeout_s=120
                )
                killed.append((run.returncode, run.seconds))
            except TimeoutError:
                killed.append((None, 120.0))  # killed: it hung
        reference.result()  # an uninterrupted run that failed raises here
    rows = []
    for i, (code, seconds) in enumerate(killed):
        done = code == 0 and (work / f"run{i}" / "w.pt").exists()
        same = done and same_weights(work / "reference" / "w.pt", work / f"run{i}" / "w.pt")
        rows.append({"run": i + 1, "seconds": round(seconds, 1), "exit": code, "identical": same})
    return rows


def stuck_save(
    workdir: str | os.PathLike[str], step_timeout: float = 5.0, hang_at: int = 10
) -> dict[str, Any]:
    """A save that blocks forever at step ``hang_at``, under ``--step-timeout``: recovered?

    The uninterrupted run it compares with is ``workdir/reference``, made by an earlier
    `readme_runs` in the same ``workdir`` or here.

    Returns the exit code, whether the final weights equal an uninterrupted run's, the
    trainer's lines around the hang and the restart, torchrun's lines about the expired timer
    and the failed worker, and a one-line verdict.
    """
    work = Path(workdir)
    _reference(work)
    args = [
        *README_ARGS,
        "--step-timeout",
        str(step_timeout),
        "--hang-in-save-at-step",
        str(hang_at),
    ]
    run = _run_in(work, "stuck", args, timeout_s=180, env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"})
    same = run.returncode == 0 and same_weights(
        work / "reference" / "w.pt", work / "stuck" / "w.pt"
    )
    keep = ("injected hang", "start:", "resumed", "done", f"step {hang_at} loss")
    trainer = [ln for ln in run.stdout.splitlines() if any(k in ln for k in keep)]
    agent = [
        ln.split("] ", 1)[-1]
        for ln in run.stderr.splitlines()
        if "failed (exitcode" in ln or "Reaping worker" in ln
    ]
    ended = sorted(set(re.findall(r"exitcode: -(\d+)\) local_rank: (\d+)", run.stderr)))
    # Which rank the timer server reaps first is a race: rank 0 hangs in its save, the
    # others wait for it inside the same guarded save, and all their timers run out within
    # microseconds of each other. The verdict names the signal, never the rank.
    verdict = (
        f"save stuck at step {hang_at}: torchrun's file timer ended "
        f"{'a worker' if ended else 'no worker'} of the stuck save after {step_timeout:g} s "
        f"(signal {', '.join(sorted({n for n, _ in ended})) or '-'}), torchrun restarted, exit "
        f"{run.returncode}, " + ("bit-identical to the uninterrupted run" if same else "DIFFERENT")
    )
    ref_ok = (work / "reference" / "w.pt").exists()
    return {
        "returncode": run.returncode,
        "identical": same,
        "ref_ok": ref_ok,
        "seconds": round(run.seconds, 1),
        "trainer": trainer,
        "agent": agent,
        "ended": [(int(r), int(n)) for n, r in ended],
        "verdict": verdict,
    }


def _agent_time(match: re.Match[str], year: int) -> float:
    month, day, hh, mm, ss = match.groups()[:5]
    sec = float(ss)
    when = datetime.datetime(year, int(month), int(day), int(hh), int(mm), int(sec))
    return when.timestamp() + sec % 1  # torchrun logs local time


def split_restarts(run: TrainRun) -> list[dict[str, float]]:
    """Each kill of ``run`` (``run_train(..., kills=...)`` with ``--log-times`` and torchrun's
    ``LOGLEVEL=INFO``) as R and its `PARTS`, in seconds."""
    year = datetime.datetime.now().year
    failed, rdzv = [], []
    for line in run.stderr.splitlines():
        m = _AGENT.match(line)
        if m and "Worker group FAILED" in m.group(6):
            failed.append(_agent_time(m, year))
        elif m and "Rendezvous complete for workers" in m.group(6):
            rdzv.append(_agent_time(m, year))
    attempts: dict[int, dict[str, float]] = {}
    attempt: dict[int, int] = {}
    for line in run.stdout.splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        rank, t, msg = int(m.group(1)), float(m.group(2)), m.group(3)
        if (s := re.search(r"start: world \d+, restart (\d+)", msg)) is not None:
            attempt[rank] = int(s.group(1))
        pattern = r"timing: restart (\d+) process ([\d.]+) imported ([\d.]+) group ([\d.]+)"
        if (tm := re.search(pattern, msg)) is not None:  # logged before "start:"
            a = attempts.setdefault(int(tm.group(1)), {})
            for key, value in zip(("process", "imported", "group"), tm.groups()[1:], strict=True):
                a[key] = max(a.get(key, 0.0), float(value))  # the slower rank sets the pace
            continue
        a = attempts.setdefault(attempt.get(rank, 0), {})
        if rank == 0 and msg.startswith("resumed from"):
            a["loaded"] = t
        elif rank == 0 and "loss" in msg and "first" not in a and "loaded" in a:
            a["first"] = t
    rows = []
    for k, kill in enumerate(run.kill_times):
        a, fail = attempts.get(k + 1, {}), next((t for t in failed if t >= kill - 0.01), None)
        done = next((t for t in rdzv if fail is not None and t >= fail), None)
        if fail is None or done is None or "first" not in a:
            continue  # this kill did not lead to a resumed step in the log: left out
        marks = [kill, fail, done, a["process"], a["imported"], a["group"], a["loaded"], a["first"]]
        row = {p: round(marks[i + 1] - marks[i], 3) for i, p in enumerate(PARTS)}
        rows.append({"R": round(a["first"] - kill, 3), **row})
    return rows


def restart_cost(workdir: str | os.PathLike[str], kills: int = 5) -> dict[str, Any]:
    """SIGKILL rank 1 ``kills`` times (once per attempt, two steps after a save) and return
    each restart's R and parts, and their median and spread (min, max) over the kills."""
    steps = 6 * (kills + 1)
    args = [
        "--steps",
        str(steps),
        "--save-every",
        "3",
        "--seed",
        "3",
        "--ckpt-dir",
        "ck",
        "--log-times",
    ]
    where = [(1, 6 * k + 5) for k in range(kills)]  # rank 1, once rank 0 logged that step
    run = _run_in(
        Path(workdir),
        "cost",
        args,
        max_restarts=kills,
        timeout_s=60.0 * (kills + 1),
        kills=where,
        env={"LOGLEVEL": "INFO"},
    )
    if run.returncode != 0:
        raise RuntimeError(f"the killed run did not finish:\n{run.stderr[-3000:]}")
    rows = split_restarts(run)
    summary = {}
    for part in ("R", *PARTS):
        values = [r[part] for r in rows]
        if values:
            summary[part] = {
                "median": round(statistics.median(values), 3),
                "min": min(values),
                "max": max(values),
            }
    return {"kills": len(run.kill_times), "measured": len(rows), "rows": rows, "summary": summary}
