"""Chapter 10's harness: run `refimpl.train` as a reader would, signal a rank, read the log.

`run_train` starts ``torchrun ... -m refimpl.train`` (or plain ``python -m refimpl.train``) in a
subprocess, with ``PYTHONUNBUFFERED`` removed from its environment, so the log is what a job's
log file would hold; it can SIGTERM one rank once that step has been logged (a preemption).
`parse_log` turns the ``[rankR] ...`` lines into events, `attempts` into one summary per
torchrun attempt (where it resumed, the losses it logged, how it ended), and `plot_attempts`
draws them. `same_weights` is the bit-for-bit comparison of two ``--final-weights`` files.

Signalling a rank reads ``/proc`` (which process is torchrun's worker with ``RANK=r``): Linux.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from refimpl.checkpoint import safe_load

__all__ = ["Event", "TrainRun", "attempts", "parse_log", "plot_attempts", "run_train"]
__all__ += ["same_weights", "train_command"]

_PATTERNS = {
    "start": re.compile(r"start: world (\d+), restart (\d+)"),
    "fresh": re.compile(r"no checkpoint in"),
    "resume": re.compile(r"resumed from step_(\d+)"),
    "loss": re.compile(r"step (\d+) loss ([-\d.e]+)"),
    "save": re.compile(r"saved step_0*(\d+)"),
    "fault": re.compile(r"injected fault: .* step (\d+)"),
    "stop": re.compile(r"SIGTERM: stopped after step (\d+)"),
    "final": re.compile(r"final weights at step (\d+)"),
    "done": re.compile(r"done: (\d+) steps"),
}
_LINE = re.compile(r"^\[rank(\d+)\] (.*)$")


@dataclass(frozen=True)
class Event:
    """One ``[rankR]`` log line: the torchrun attempt (restart count) it belongs to, its kind
    (start, fresh, resume, loss, save, fault, stop, final, done) and its step (or None)."""

    attempt: int
    rank: int
    kind: str
    step: int | None
    value: float | None = None


@dataclass
class TrainRun:
    """What `run_train` saw: the exit status, both streams and the wall-clock seconds."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    events: list[Event] = field(default_factory=list)
    kill_times: list[float] = field(default_factory=list)  # Unix time of each SIGKILL sent


def train_command(
    train_args: Sequence[str], *, launcher: str = "torchrun", nproc: int = 2, max_restarts: int = 2
) -> list[str]:
    """The command line: ``torchrun --standalone ... -m refimpl.train ARGS`` or ``python -m``."""
    if launcher == "python":
        return [sys.executable, "-m", "refimpl.train", *train_args]
    if launcher != "torchrun":
        raise ValueError(f"launcher must be 'torchrun' or 'python', not {launcher!r}")
    torchrun = Path(sys.executable).with_name("torchrun")  # the one of this environment
    head = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [
        *head,
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        "refimpl.train",
        *train_args,
    ]


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent's pid
                found.append(int(entry))
    return found


def _worker_pid(torchrun_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker whose environment has ``RANK=rank``."""
    for pid in _children(torchrun_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (torchrun's workers run in sessions of their own)."""
    pids, i = [pid], 0
    while i < len(pids):
        pids += _children(pids[i])
        i += 1
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run_train(
    train_args: Sequence[str],
    *,
    launcher: str = "torchrun",
    nproc: int = 2,
    max_restarts: int = 2,
    sigterm_rank: int | None = None,
    sigterm_after_step: int = 1,
    timeout_s: float = 120.0,
    cwd: str | os.PathLike[str] | None = None,
    fresh_store: bool = False,
    kills: Sequence[tuple[int, int]] = (),
    env: dict[str, str] | None = None,
) -> TrainRun:
    """Run the trainer in a subprocess and return what it did; never hangs past ``timeout_s``.

    With ``sigterm_rank``, that rank (the process itself for ``launcher="python"``) gets one
    SIGTERM as soon as rank 0 has logged step ``sigterm_after_step``. On a timeout, the whole
    process tree is killed and `TimeoutError` is raised with the output so far.

    ``kills``: for each ``(rank, step)``, in order, SIGKILL that rank's worker once rank 0 of the
    next attempt (restart count 0, then 1, ...) has logged ``step``; the times they were sent
    come back in ``kill_times``. ``env`` adds to the environment.

    torchrun runs on its shared store, as a reader's would: `refimpl.launch.init_from_env`
    scopes each attempt's keys. ``fresh_store=True`` sets
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` instead (a new store per attempt, which a trainer
    that calls ``init_process_group`` itself needs on torch 2.13, pytorch/pytorch#135712).
    """
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "PYTHONUNBUFFERED"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if fresh_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = train_command(train_args, launcher=launcher, nproc=nproc, max_restarts=max_restarts)
    to_kill, kill_times, attempt = list(kills), list[float](), 0
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=cwd
        )
        fired = threading.Event()

        def on_timeout() -> None:
            fired.set()
            _kill_tree(proc.pid)

        timer = threading.Timer(timeout_s, on_timeout)
        timer.start()
        lines: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                loss = _PATTERNS["loss"].search(line)
                started = _PATTERNS["start"].search(line)
                if started and line.startswith("[rank0]"):
                    attempt = int(started.group(2))
                if to_kill and loss and attempt == len(kill_times) and line.startswith("[rank0]"):
                    rank, at_step = to_kill[0]
                    pid = _worker_pid(proc.pid, rank)
                    if int(loss.group(1)) >= at_step and pid is not None:
                        kill_times.append(time.time())
                        os.kill(pid, signal.SIGKILL)
                        to_kill.pop(0)
                if sigterm_rank is not None and loss and int(loss.group(1)) >= sigterm_after_step:
                    pid = proc.pid if launcher == "python" else _worker_pid(proc.pid, sigterm_rank)
                    if pid is not None:
                        os.kill(pid, signal.SIGTERM)
                        sigterm_rank = None
            returncode = proc.wait()
        finally:
            timer.cancel()
        err.seek(0)
        stderr = err.read()
    seconds = time.monotonic() - start
    stdout = "".join(lines)
    if fired.is_set():
        raise TimeoutError(f"{' '.join(cmd)} ran past {timeout_s} s and was killed:\n{stdout}")
    return TrainRun(returncode, stdout, stderr, seconds, parse_log(stdout), kill_times)


def parse_log(text: str) -> list[Event]:
    """The trainer's ``[rankR] ...`` lines as events, in order; other lines are ignored."""
    events: list[Event] = []
    attempt: dict[int, int] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        rank, message = int(m.group(1)), m.group(2)
        for kind, pattern in _PATTERNS.items():
            found = pattern.search(message)
            if not found:
                continue
            if kind == "start":
                attempt[rank] = int(found.group(2))
            groups = found.groups()
            step = None if kind in ("start", "fresh") else int(groups[0])
            value = float(groups[1]) if kind == "loss" else None
            events.append(
                Event(attempt.get(rank, 0), rank, kind, 0 if kind == "fresh" else step, value)
            )
            break
    return events


def attempts(events: Sequence[Event]) -> list[dict[str, Any]]:
    """One summary per attempt: where it started, rank 0's losses by step, the steps saved,
    and how it ended (``"fault on rank R at step S"``, ``"SIGTERM after step S"``, ``"done"``)."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        a = out.setdefault(
            e.attempt,
            {
                "attempt": e.attempt,
                "resumed_from": None,
                "losses": {},
                "saved": [],
                "end": "killed",
            },
        )
        if e.kind in ("fresh", "resume") and e.rank == 0:
            a["resumed_from"] = e.step
        elif e.kind == "loss":
            a["losses"][e.step] = e.value
        elif e.kind == "save":
            a["saved"].append(e.step)
        elif e.kind == "fault":
            a["end"] = f"fault on rank {e.rank} at step {e.step}"
        elif e.kind == "stop" and e.rank == 0:
            a["end"] = f"SIGTERM after step {e.step}"
        elif e.kind == "done" and a["end"] == "killed":
            a["end"] = f"done at step {e.step}"
    return [out[k] for k in sorted(out)]


def same_weights(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two ``--final-weights`` files hold the same keys and bit-identical tensors."""
    wa, wb = safe_load(a), safe_load(b)
    return list(wa) == list(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


def plot_attempts(summary: Sequence[dict[str, Any]], ax: Any = None) -> Any:
    """One row per attempt: the steps it trained, its saves (dots) and how it ended."""
    import matplotlib.pyplot as plt

    ax = ax if ax is not None else plt.subplots(figsize=(8, 0.6 + 0.5 * len(summary)))[1]
    right = 0.0
    for row, a in enumerate(summary):
        first = (a["resumed_from"] or 0) + 1
        last = max(a["losses"], default=first - 1)
        ax.barh(row, last - first + 1, left=first - 0.5, height=0.5, color="C0", alpha=0.6)
        ax.plot(a["saved"], [row] * len(a["saved"]), "o", color="C2", label="_")
        end = last + 0.5  # the label starts right of the bar, or of the cross where it died
        if a["end"].startswith("fault"):
            died = int(a["end"].rsplit(" ", 1)[1])
            ax.plot(died, row, "x", color="C3", ms=12, mew=3)
            end = max(end, died + 0.4)
        ax.text(end + 0.2, row, a["end"], va="center", fontsize=9)
        right = max(right, end)
    ax.set_xlim(0.3, right + 0.2 + 0.3 * max(len(a["end"]) for a in summary))
    steps = int(right)
    ax.set_xticks(range(1 if steps < 10 else 2, steps + 1, 1 if steps < 10 else 2))
    ax.set_yticks(range(len(summary)), [f"attempt {a['attempt']}" for a in summary])
    ax.invert_yaxis()
    ax.set_xlabel("step (dots: checkpoints saved)")
    return ax
