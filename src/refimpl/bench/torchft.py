"""``python -m refimpl.bench torchft --out DIR``: restart-from-checkpoint against torchft.

The same job (chapter 10's model, 2 workers, a batch of 8 each, ``--steps`` optimizer steps
with ``--step-sleep`` seconds of extra work each, a refimpl checkpoint every ``--save-every``
steps) runs three ways, under the same failure schedule:

- ``restart_sync``: ``torchrun --max-restarts`` with `refimpl.train` (DDP, rank 0's atomic
  file save): a failure restarts both workers, which reload the last checkpoint;
- ``restart_async``: the same with ``--sharded --async-save`` (FSDP2, DCP written while the
  next steps train);
- ``torchft``: two replica groups of one rank (`refimpl.demos.torchft_job`): a failure costs the
  survivor a refused step and a shorter quorum; the killed group is started again at once and
  heals from its peer. It also writes refimpl checkpoints (one group), for whole-job failures.

The failure schedule: one worker SIGKILLed after every ``T`` seconds of whole-job uptime
(for each ``T`` of ``--intervals``): the first ``T`` seconds after the first training step,
each next one ``T`` seconds after the killed worker trains again (restart: the restarted
job's first step; torchft: the replacement's first committed step). Counting from the repair
keeps a job whose repair takes longer than ``T`` from being killed before it makes any
progress (a restart-based job does exactly that when failures come faster than it restarts).
Each (approach, T) runs ``--repeats`` times, interleaved with the failure-free runs of every
approach (the floors), so each ratio compares runs made minutes apart on the same machine.
Reported per run: wall time from launch to the last optimizer step, kills, optimizer steps
lost (restart: steps past the checkpoint that the restart trains again; torchft: step attempts
refused), the time from each kill to the killed worker's return (its first trained step),
and the step efficiency: the failure-free run's median wall time over this run's. The
per-failure cost is the extra wall time over the failure-free median, divided by the kills.
Writes ``torchft.json`` and ``torchft.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from refimpl.bench import summarize, write_json
from refimpl.demos.torchft_job import run_ft_job
from refimpl.demos.train import train_command

APPROACHES = ("restart_sync", "restart_async", "torchft")
LABELS = {
    "restart_sync": "torchrun restart, sync checkpoint",
    "restart_async": "torchrun restart, async checkpoint",
    "torchft": "torchft live recovery",
}
_STEP = re.compile(r"^\[rank0\] step (\d+) loss")
_RESUMED = re.compile(r"^\[rank0\] resumed from step_0*(\d+)")


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def _worker(torchrun: int, rank: int) -> int | None:
    for pid in _children(torchrun):
        with contextlib.suppress(OSError):
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
    return None


def _kill_tree(pid: int) -> None:
    pids, i = [pid], 0
    while i < len(pids):
        pids += _children(pids[i])
        i += 1
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run_restart(
    work: Path, args: argparse.Namespace, *, asynchronous: bool, interval: float | None
) -> dict[str, Any]:
    """One torchrun job of `refimpl.train`, a worker SIGKILLed every ``interval`` s of training."""
    train = [
        "--steps",
        str(args.steps),
        "--save-every",
        str(args.save_every),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--step-sleep",
        str(args.step_sleep),
        "--progress",
        "never",
        "--pg-timeout",
        "30",
    ]
    if asynchronous:
        train += ["--sharded", "--async-save"]
    cmd = train_command(train, nproc=2, max_restarts=1000)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["OMP_NUM_THREADS"] = "1"
    lines: list[tuple[float, str]] = []
    lock = threading.Lock()
    launched = time.monotonic()
    kills: list[float] = []
    state: dict[str, Any] = {"next_kill": None, "agent_crashes": 0}
    while True:  # a torchrun agent that crashed is run again, as a requeue would
        code = _launch(cmd, env, work, args, interval, launched, lines, lock, kills, state)
        if code == 0:
            break
        if "Failed to parse reply file" not in (work / "stderr.txt").read_text():
            raise RuntimeError(f"{cmd} exited with {code}; see {work / 'stderr.txt'}")
        state["agent_crashes"] += 1
    # to the last optimizer step, not the exit: the final weights and teardown are not steps
    last = [t for t, x in lines if (m := _STEP.match(x)) and int(m[1]) == args.steps]
    wall = min(last) - launched
    lost, returns = 0, []
    for t_kill in kills:
        before = [int(m[1]) for t, x in lines if t < t_kill and (m := _STEP.match(x))]
        resumed = [int(m[1]) for t, x in lines if t > t_kill and (m := _RESUMED.match(x))]
        back = [t for t, x in lines if t > t_kill and _STEP.match(x)]
        if before and resumed:
            lost += max(0, max(before) - resumed[0])
        if back:
            returns.append(back[0] - t_kill)
    return {
        "wall_s": wall,
        "kills": len(kills),
        "steps_lost": lost,
        "return_s": returns,
        "train_s": _span([t for t, x in lines if _STEP.match(x)]),
        "agent_crashes": state["agent_crashes"],
    }


def _launch(
    cmd: list[str],
    env: dict[str, str],
    work: Path,
    args: argparse.Namespace,
    interval: float | None,
    launched: float,
    lines: list[tuple[float, str]],
    lock: threading.Lock,
    kills: list[float],
    state: dict[str, Any],
) -> int:
    """Run torchrun once, sending the kills that fall due; its exit code."""
    with open(work / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )

        def read() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                with lock:
                    lines.append((time.monotonic(), raw.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while proc.poll() is None:
                if time.monotonic() - launched > args.timeout:
                    tail = "\n".join(f"{t - launched:7.2f} {x}" for t, x in lines[-15:])
                    raise TimeoutError(f"{cmd} did not finish in {args.timeout} s:\n{tail}")
                with lock:
                    steps = [t for t, text in lines if _STEP.match(text)]
                back = [t for t in steps if not kills or t > kills[-1]]  # trained since
                if state["next_kill"] is None and back and interval:
                    state["next_kill"] = back[0] + interval
                with lock:
                    done = any((m := _STEP.match(x)) and int(m[1]) >= args.steps for _, x in lines)
                due = state["next_kill"] is not None and time.monotonic() >= state["next_kill"]
                if due and not done:  # after the last step there is nothing left to lose
                    pid = _worker(proc.pid, len(kills) % 2)
                    if pid is not None:
                        kills.append(time.monotonic())
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        state["next_kill"] = None
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                _kill_tree(proc.pid)
            proc.wait(timeout=30)
            reader.join(timeout=10)
    return proc.returncode


def run_torchft(work: Path, args: argparse.Namespace, *, interval: float | None) -> dict[str, Any]:
    """One torchft job of two groups, a group SIGKILLed every ``interval`` s of training."""
    launched = time.time()
    job = run_ft_job(
        work,
        replicas=2,
        steps=args.steps,
        step_sleep=args.step_sleep,
        kill_every=interval,
        ckpt_dir=work / "ckpt",
        save_every=args.save_every,
        timeout_s=args.timeout,
    )
    # to the last committed step, not the exit: a replacement still starting when the job
    # is done only has to notice that and leave
    last = [x.t for x in job.step_lines() if x.committed and x.step == args.steps - 1]
    wall = min(last) - launched
    return {
        "wall_s": wall,
        "kills": len(job.kills),
        "steps_lost": len({s for s, _ in job.aborted()}),
        "return_s": job.return_times(),
        "train_s": _span([x.t for x in job.step_lines()]),
        "group_steps_missing": sum(2 - len(g) for g in job.committed_by().values()),
    }


def _span(times: Sequence[float]) -> float:
    """Seconds from the first training step logged to the last (0 for fewer than two)."""
    return max(times) - min(times) if len(times) > 1 else 0.0


def _one(
    approach: str, work: Path, args: argparse.Namespace, interval: float | None
) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if approach == "torchft":
        row = run_torchft(work, args, interval=interval)
    else:
        row = run_restart(work, args, asynchronous=approach == "restart_async", interval=interval)
    shutil.rmtree(work, ignore_errors=True)
    return {"approach": approach, "interval_s": interval, **row}


def crossover(o: float, c_ft: float, c_save: float, r: float) -> float | None:
    """The failure rate (per second) above which torchft wastes less than restarting.

    Restart: Young's first-order waste at the best interval, sqrt(2 C lambda) + R lambda;
    torchft: a fixed per-step overhead ``o`` (a fraction) plus ``c_ft`` seconds per failure.
    Searched over 1e-9..1 failures per second: 0.0 when torchft wastes no more at every rate
    there (an overhead ``o`` <= 0), None when it never wastes less.
    """

    def gap(lam: float) -> float:
        return float((o + c_ft * lam) - ((2 * c_save * lam) ** 0.5 + r * lam))

    lams = [10 ** (-9 + 9 * i / 2000) for i in range(2001)]
    if gap(lams[0]) <= 0:
        return 0.0
    for a, b in itertools.pairwise(lams):
        if gap(a) > 0 >= gap(b):
            for _ in range(60):  # bisection
                mid = (a + b) / 2
                a, b = (mid, b) if gap(mid) > 0 else (a, mid)
            return b
    return None


def figure(data: dict[str, Any]) -> Any:
    """Step efficiency (left) and kill -> return time (right) per failure interval: a Figure."""
    from matplotlib.figure import Figure  # no pyplot: no backend is chosen or changed

    fig = Figure(figsize=(10, 3.8))
    ax1, ax2 = fig.subplots(1, 2)
    intervals = data["config"]["intervals"]
    names = [a for a in APPROACHES if a in data["summary"]]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(intervals))]
        for ax, key in ((ax1, "efficiency"), (ax2, "return_s")):
            stats = [data["summary"][name][str(t)][key] for t in intervals]
            med = [s["median"] if s else 0.0 for s in stats]
            lo = [m - s["min"] if s else 0.0 for m, s in zip(med, stats, strict=True)]
            hi = [s["max"] - m if s else 0.0 for m, s in zip(med, stats, strict=True)]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=LABELS[name])
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(intervals)), [f"every {t:g} s" for t in intervals])
        ax.set_xlabel("one worker SIGKILLed after each T s of uptime")
    ax1.set_ylabel("step efficiency\n(failure-free wall time / wall time)")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax2.set_ylabel("kill -> worker trains again (s)")
    ax1.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def run_chaos_cli(work: Path, timeout: float) -> dict[str, Any]:
    """``python -m refimpl.chaos`` (its README command line) against the torchft job.

    Scenarios ``kill-rank1`` (replica group 1 SIGKILLed at step 25; the job's supervisor
    starts it again and it heals from its peer) and ``kill-job`` (every process SIGKILLed,
    then the command run again: the groups resume from the refimpl checkpoint of step 20).
    Returns the exit status and the rows of its ``--json``.
    """
    out = work / "chaos.json"
    cmd = [
        sys.executable,
        "-m",
        "refimpl.chaos",
        "--kill-on",
        r"\] step 25 participants",
        "--compare",
        "final.pt",
        "--json",
        str(out),
        "--timeout",
        str(timeout),
        "--scenarios",
        "kill-rank1,kill-job",
        "--",
        sys.executable,
        "-m",
        "refimpl.demos.torchft_job",
        "--out",
        "{out}",
        "--replicas",
        "2",
        "--steps",
        "40",
        "--step-sleep",
        "0.05",
        "--ckpt-dir",
        "{out}/ckpt",
        "--save-every",
        "10",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=4 * timeout)
    if not out.exists():
        raise RuntimeError(
            f"refimpl.chaos wrote no {out}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return {"command": cmd[3:], "returncode": done.returncode, "rows": json.loads(out.read_text())}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison; write ``torchft.json`` and ``torchft.png`` to ``--out``; 0."""
    p = argparse.ArgumentParser(prog="python -m refimpl.bench torchft")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--intervals", default="5,10,20", help="seconds between kills, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--approaches", default=",".join(APPROACHES), help="a comma-separated subset")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument(
        "--no-chaos",
        dest="chaos",
        action="store_false",
        help="skip the refimpl.chaos run against the torchft job",
    )
    args = p.parse_args(argv)
    intervals = [float(x) for x in args.intervals.split(",")]
    approaches = [a for a in APPROACHES if a in args.approaches.split(",")]
    if not approaches:
        p.error(f"--approaches: none of {args.approaches!r} is one of {','.join(APPROACHES)}")
    out = Path(args.out)
    load_before = os.getloadavg()
    started = time.time()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-torchft-") as tmp:
        for repeat in range(args.repeats):
            for interval in [None, *intervals]:
                for approach in approaches:
                    row = _one(approach, Path(tmp) / approach, args, interval)
                    rows.append({**row, "repeat": repeat})
                    print(
                        f"{approach:14} every {interval or 0:>4g} s  wall {row['wall_s']:6.1f} s"
                        f"  kills {row['kills']}  lost {row['steps_lost']}",
                        flush=True,
                    )
        chaos = run_chaos_cli(Path(tmp), args.timeout) if args.chaos else None
    floor = {
        a: statistics.median(
            r["wall_s"] for r in rows if r["approach"] == a and r["interval_s"] is None
        )
        for a in approaches
    }
    summary: dict[str, Any] = {}
    for a in approaches:
        summary[a] = {
            "failure_free_train_s": summarize(
                [r["train_s"] for r in rows if r["approach"] == a and r["interval_s"] is None]
            ),
            "failure_free_wall_s": summarize(
                [r["wall_s"] for r in rows if r["approach"] == a and r["interval_s"] is None]
            ),
        }
        for t in intervals:
            mine = [r for r in rows if r["approach"] == a and r["interval_s"] == t]
            for r in mine:
                r["efficiency"] = floor[a] / r["wall_s"]
                r["cost_per_failure_s"] = (
                    (r["wall_s"] - floor[a]) / r["kills"] if r["kills"] else None
                )
            costs = [r["cost_per_failure_s"] for r in mine if r["cost_per_failure_s"] is not None]
            returns = [x for r in mine for x in r["return_s"]]
            summary[a][str(t)] = {
                "wall_s": summarize([r["wall_s"] for r in mine]),
                "efficiency": summarize([r["efficiency"] for r in mine]),
                "steps_lost": summarize([float(r["steps_lost"]) for r in mine]),
                "kills": summarize([float(r["kills"]) for r in mine]),
                "return_s": summarize(returns) if returns else None,
                "cost_per_failure_s": summarize(costs) if costs else None,
            }
    data = {
        "config": {
            "steps": args.steps,
            "step_sleep": args.step_sleep,
            "save_every": args.save_every,
            "intervals": intervals,
            "repeats": args.repeats,
            "workers": 2,
            "batch_per_worker": 8,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "load_before": list(load_before),
            "load_after": list(os.getloadavg()),
            "started_unix": started,
            "seconds": time.time() - started,
        },
        "rows": rows,
        "summary": summary,
        "chaos": chaos,
    }
    write_json(out, "torchft", data)
    with contextlib.suppress(ImportError):
        figure(data).savefig(out / "torchft.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
