"""Chapter 13: a torchft job on one machine: a Lighthouse, G replica groups, kills, replacements.

`run_ft_job` starts torchft's `LighthouseServer` in this process and G replica groups
(`refimpl.demos.torchft_replica`, one gloo rank each) as subprocesses, supervises them as a
per-group torchrun would (a group that dies is started again, up to ``max_restarts`` times),
optionally kills them (a replica that SIGKILLs itself at a step, or SIGKILLs from here every
``kill_every`` seconds), and returns what every group printed, with the kill and start times.
`FTJob`'s methods turn the lines into the chapter's evidence: the groups in each committed
step, the aborted steps, the heals, the samples each step trained.

Nothing can hang or leak: every replica gets ``PR_SET_PDEATHSIG`` (it dies with this process)
and its own exit timer, and every process started here is SIGKILLed when `run_ft_job`
returns or raises (a timeout is a `TimeoutError` with the lines so far).

Command line (for ``python -m refimpl.chaos``; ``final.pt`` is replica 0's final weights, or
the first replica's that finished)::

    python -m refimpl.demos.torchft_job --out DIR --replicas 2 --steps 40 --ckpt-dir DIR/ckpt
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec

__all__ = [
    "FTJob",
    "StepLine",
    "final_weights",
    "main",
    "max_difference",
    "replay_weights",
    "run_ft_job",
    "sample_counts",
]

_STEP = re.compile(r"^\[replica (\d+)\] step (\d+) participants (\d+) commit ([01]) t ([\d.]+)$")
_HEAL = re.compile(r"^\[replica (\d+)\] healed: step (\d+) -> (\d+)$")
_PR_SET_PDEATHSIG = 1
_P = ParamSpec("_P")


@dataclass(frozen=True)
class StepLine:
    """One replica group's report of one step attempt."""

    replica: int
    step: int  # the committed step count before the attempt (0-based step number)
    participants: int  # groups in the quorum of this attempt
    committed: bool  # should_commit() said yes: the optimizer stepped
    t: float  # Unix time the attempt ended


@dataclass
class FTJob:
    """What `run_ft_job` saw: lines as ``(unix_time, replica, text)``, kills and starts."""

    out: Path
    replicas: int
    steps: int
    batch_size: int
    samples: int
    seed: int
    lr: float
    seconds: float  # from the start gate (every group ready) to the last group's exit
    started: float  # Unix time of the start gate
    lines: list[tuple[float, int, str]] = field(default_factory=list)
    kills: list[tuple[float, int]] = field(default_factory=list)
    starts: list[tuple[float, int]] = field(default_factory=list)
    start_retries: int = 0  # jobs started again because a group missed the first quorum

    def step_lines(self) -> list[StepLine]:
        """Every step attempt of every group, in the order the lines arrived."""
        found = []
        for _, _, text in self.lines:
            if m := _STEP.match(text):
                r, s, p, c, t = m.groups()
                found.append(StepLine(int(r), int(s), int(p), c == "1", float(t)))
        return found

    def heals(self) -> list[tuple[int, int, int]]:
        """``(replica, from_step, to_step)`` for each group that took a peer's state."""
        return [
            (int(m[1]), int(m[2]), int(m[3])) for _, _, t in self.lines if (m := _HEAL.match(t))
        ]

    def committed_by(self) -> dict[int, list[int]]:
        """Committed step -> the groups that committed it (the quorum that trained it)."""
        by: dict[int, list[int]] = {}
        for line in self.step_lines():
            if line.committed:
                by.setdefault(line.step, []).append(line.replica)
        return {s: sorted(g) for s, g in sorted(by.items())}

    def quorum_runs(self) -> list[tuple[int, int, list[int]]]:
        """``(first_step, last_step, groups)``: runs of steps committed by the same groups."""
        runs: list[tuple[int, int, list[int]]] = []
        for step, groups in self.committed_by().items():
            if runs and runs[-1][2] == groups and runs[-1][1] == step - 1:
                runs[-1] = (runs[-1][0], step, groups)
            else:
                runs.append((step, step, groups))
        return runs

    def aborted(self) -> list[tuple[int, int]]:
        """``(step, replica)`` of attempts whose commit was refused (the step was redone)."""
        return [(x.step, x.replica) for x in self.step_lines() if not x.committed]

    def return_times(self) -> list[float]:
        """Seconds from each kill to the killed group's next committed step (its return)."""
        out = []
        for t_kill, replica in self.kills:
            later = [
                x.t
                for x in self.step_lines()
                if x.replica == replica and x.committed and x.t > t_kill
            ]
            if later:
                out.append(min(later) - t_kill)
        return out


def sample_counts(job: FTJob) -> dict[int, Counter[int]]:
    """Epoch -> how many times each sample was trained in a committed step (absent: never)."""
    from refimpl.torchft_checkpoint import batch_for_step

    per_epoch = job.samples // (job.replicas * job.batch_size)
    counts: dict[int, Counter[int]] = {}
    for step, groups in job.committed_by().items():
        c = counts.setdefault(step // per_epoch, Counter())
        for g in groups:
            c.update(
                batch_for_step(
                    step,
                    replica=g,
                    replicas=job.replicas,
                    dataset_len=job.samples,
                    batch_size=job.batch_size,
                    seed=job.seed,
                )
            )
    return counts


def replay_weights(job: FTJob, *, every_group: bool = False) -> dict[str, Any]:
    """Train the same model in this process on the batches the job committed; its weights.

    Each committed step trains the concatenated batches of the groups that committed it (the
    mean of equal-sized groups' mean losses is the mean loss over all their samples, which is
    what averaging their gradients computes). ``every_group=True`` trains every group's batch
    at every step instead: the uninterrupted run. The replay sums in another order than gloo's
    all-reduce, so it matches the job to rounding, not bit for bit.
    """
    import torch

    from refimpl.torchft_checkpoint import batch_for_step
    from refimpl.train import make_data, make_model

    model = make_model(job.seed, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr)
    x, y = make_data(job.samples, job.seed)
    by = job.committed_by()
    for step in range(job.steps):
        groups = list(range(job.replicas)) if every_group else by[step]
        idx = [
            i
            for g in groups
            for i in batch_for_step(
                step,
                replica=g,
                replicas=job.replicas,
                dataset_len=job.samples,
                batch_size=job.batch_size,
                seed=job.seed,
            )
        ]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return model.state_dict()


def final_weights(job: FTJob) -> dict[int, dict[str, Any]]:
    """Replica -> the final weights it wrote (groups that finished the job)."""
    import torch

    return {
        int(p.stem.removeprefix("replica")): torch.load(p, weights_only=True)
        for p in sorted(job.out.glob("replica*.pt"))
    }


def max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest absolute difference between two state dicts' tensors (same keys)."""
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _Replicas:
    """The running replica processes, their reader threads and the lines they printed."""

    def __init__(self, echo: bool) -> None:
        self.lines: list[tuple[float, int, str]] = []
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.all: list[subprocess.Popen[str]] = []
        self.echo = echo

    def start(self, replica: int, cmd: list[str], env: dict[str, str], err: Path) -> None:
        with open(err, "a") as stderr:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
                preexec_fn=_die_with_parent,
            )
        self.procs[replica] = proc
        self.all.append(proc)
        threading.Thread(target=self._read, args=(replica, proc), daemon=True).start()

    def _read(self, replica: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            text = raw.rstrip("\n")
            with self.lock:
                self.lines.append((time.time(), replica, text))
            if self.echo:
                sys.stdout.write(text + "\n")
                sys.stdout.flush()

    def snapshot(self) -> list[tuple[float, int, str]]:
        with self.lock:
            return list(self.lines)

    def kill_all(self) -> None:
        for proc in self.all:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for proc in self.all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def _retried_if_a_group_missed_the_first_quorum(
    start: Callable[_P, FTJob],
) -> Callable[_P, FTJob]:
    """`start` (`run_ft_job`'s body), run once more when a group missed the first quorum.

    The Lighthouse forms the first quorum ``join_timeout_ms`` (3 s) after the first group
    asks; a group that asks later (seen once under a heavy ``make test``) trains from step 1,
    healed from a peer, and the chapter's sample accounting no longer holds. Without
    ``kill_every`` or ``ckpt_dir`` (a rerun would resume from its steps) the job is then
    started again once, and the second `FTJob` says so (``start_retries``).
    """
    signature = inspect.signature(start)

    @functools.wraps(start)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> FTJob:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        job = start(*args, **kwargs)
        first = job.quorum_runs()[:1]
        die = given["die"]
        may_retry = (
            given["kill_every"] is None
            and given["ckpt_dir"] is None
            and (die is None or die[1] > 0)
        )
        if may_retry and first and first[0][0] == 0 and len(first[0][2]) < given["replicas"]:
            job = start(*args, **kwargs)
            job.start_retries = 1
        return job

    return run


@_retried_if_a_group_missed_the_first_quorum
def run_ft_job(
    out: str | os.PathLike[str],
    *,
    replicas: int = 3,
    steps: int = 30,
    batch_size: int = 8,
    samples: int | None = None,
    seed: int = 0,
    step_sleep: float = 0.0,
    die: tuple[int, int] | None = None,
    hold_rejoin_at: int | None = None,
    kill_every: float | None = None,
    ckpt_dir: str | os.PathLike[str] | None = None,
    save_every: int = 10,
    max_restarts: int = 20,
    timeout_s: float = 120.0,
    echo: bool = False,
    stock_ddp: bool = False,
) -> FTJob:
    """Run a torchft job of ``replicas`` groups to ``steps`` committed steps; return what it did.

    ``die=(r, s)``: group r SIGKILLs itself in step s (after its quorum and forward pass, so
    the others' all-reduce of that step fails). ``hold_rejoin_at``: the groups that were not
    killed wait before that step until the replacement has asked the Lighthouse for a quorum,
    and the replacement asks only once they all wait, so the quorum of that step has every
    group whatever the machine's load (the Lighthouse forms a "fast quorum" as soon as the
    previous quorum's groups are all back, without a newcomer that asks a moment later).
    ``kill_every``: SIGKILL a group every so many seconds of training (groups 1, 0, 1, ... of
    2; round robin), each kill only once every group is back in the quorum: the first kill is
    due ``kill_every`` after the start, each next one ``kill_every`` after every group is back
    (seconds of whole-job uptime between failures). Dead groups are started again at once.
    ``samples`` defaults to two epochs of ``steps``.
    Raises `TimeoutError` after ``timeout_s``, and RuntimeError when a group exits with an
    error (with its stderr's tail) or its restarts run out. ``stock_ddp=True`` runs torchft's
    own DDP wrapper, whose failed all-reduce kills the survivors (see `torchft_replica`).

    Every group is in the first quorum: a job one group joined late (over 3 s after the first
    asked, on a loaded machine) is started again once, which the returned job counts in
    ``start_retries``; not with ``kill_every`` or ``ckpt_dir``, whose rerun would differ.
    """
    # The Lighthouse runs in this process and logs every quorum at INFO unless RUST_LOG says
    # otherwise; it reads the variable when the first server starts.
    os.environ.setdefault("RUST_LOG", "error")
    from torchft.coordination import LighthouseServer

    work = Path(out)
    work.mkdir(parents=True, exist_ok=True)
    gates = work / "gates"
    shutil.rmtree(gates, ignore_errors=True)
    gates.mkdir()
    for stale in work.glob("replica*.pt"):  # a rerun in the same directory writes its own
        stale.unlink()
    global_batch = replicas * batch_size
    samples = samples or global_batch * max(1, steps // 2)
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=3000,
        quorum_tick_ms=10,
        heartbeat_timeout_ms=1000,
    )
    address = lighthouse.address()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(RUST_LOG="error", OMP_NUM_THREADS="1")
    base = [
        sys.executable,
        "-m",
        "refimpl.demos.torchft_replica",
        "--replicas",
        str(replicas),
        "--lighthouse",
        address,
        "--steps",
        str(steps),
        "--batch-size",
        str(batch_size),
        "--samples",
        str(samples),
        "--seed",
        str(seed),
        "--step-sleep",
        str(step_sleep),
        "--out",
        str(work),
        "--stop-file",
        str(gates / "stop"),
        "--hold",
        f"0:{gates / 'start'}",
        "--timeout",
        str(timeout_s),
    ]
    if stock_ddp:
        base.append("--stock-ddp")
    if ckpt_dir is not None:
        base += ["--ckpt-dir", str(ckpt_dir), "--save-every", str(save_every)]
    reps = _Replicas(echo)
    job = FTJob(work, replicas, steps, batch_size, samples, seed, 1e-2, 0.0, 0.0)
    launches = Counter[int]()

    def launch(r: int, first: bool) -> None:
        cmd = [*base, "--replica", str(r), "--ready-file", str(gates / f"ready{r}.{launches[r]}")]
        if first and die is not None and die[0] == r:
            cmd += ["--die-at-step", str(die[1])]
        if first and hold_rejoin_at is not None and (die is None or die[0] != r):
            cmd += ["--hold", f"{hold_rejoin_at}:{gates / 'rejoin'}"]
        if not first and launches[r] == 1 and hold_rejoin_at is not None:
            cmd += ["--hold", f"0:{gates / 'held'}"]  # the replacement: ask once all wait
        job.starts.append((time.time(), r))
        launches[r] += 1
        reps.start(r, cmd, {**env, "RANK": str(r)}, work / f"replica{r}.stderr")

    deadline = time.monotonic() + timeout_s
    try:
        for r in range(replicas):
            launch(r, first=True)
        while not all((gates / f"ready{r}.0").exists() for r in range(replicas)):
            _check(reps, deadline, work, replicas)
            time.sleep(0.02)
        job.started = time.time()
        (gates / "start").touch()
        t0 = time.monotonic()
        next_kill = t0 + kill_every if kill_every else None
        victims = [(1 + i) % replicas for i in range(replicas)]
        finished: set[int] = set()
        while len(finished) < replicas:
            _check(reps, deadline, work, replicas)
            if hold_rejoin_at is not None and die is not None:
                _open_rejoin_gates(gates, address, replicas, die[0])
            for r, proc in list(reps.procs.items()):
                code = proc.poll()
                if code is None or r in finished:
                    continue
                if code == 0:
                    finished.add(r)
                    (gates / "stop").touch()  # no replacement may start training alone now
                elif (gates / "stop").exists():
                    finished.add(r)  # died after the job finished: nothing to replace
                elif launches[r] > max_restarts:
                    raise RuntimeError(
                        f"replica {r}: out of restarts ({max_restarts}); see "
                        f"{work / f'replica{r}.stderr'}"
                    )
                else:
                    launch(r, first=False)
            if kill_every and next_kill is None and _all_in(reps, job, replicas):
                next_kill = time.monotonic() + kill_every  # every group is back: uptime runs
            if next_kill is not None and time.monotonic() >= next_kill:
                if not (gates / "stop").exists():
                    r = victims[len(job.kills) % replicas]
                    job.kills.append((time.time(), r))
                    with contextlib.suppress(ProcessLookupError):
                        reps.procs[r].kill()
                next_kill = None
            time.sleep(0.01)
        job.seconds = time.monotonic() - t0
    finally:
        reps.kill_all()
        lighthouse.shutdown()
        job.lines = reps.snapshot()
    return job


def _open_rejoin_gates(gates: Path, lighthouse: str, replicas: int, victim: int) -> None:
    """Let the replacement ask for a quorum once the others wait, then let them ask too."""
    held, rejoin = gates / "held", gates / "rejoin"
    if rejoin.exists():
        return
    if not held.exists():
        waiting = (gates / f"rejoin.held-{r}" for r in range(replicas) if r != victim)
        if all(p.exists() for p in waiting):
            held.touch()
        return
    if (gates / f"held.held-{victim}").exists() and _quorum_askers(lighthouse) >= 1:
        rejoin.touch()  # the replacement is in the Lighthouse's next quorum


def _quorum_askers(lighthouse: str) -> int:
    """Healthy groups waiting in the Lighthouse for the next quorum (its ``/status`` page)."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy
    try:
        with direct.open(f"{lighthouse}/status", timeout=2) as page:
            text = page.read().decode("utf-8", "replace")
    except OSError:
        return 0
    found = re.search(r"\[(\d+)/\d+ participants healthy\]", text)
    return int(found.group(1)) if found else 0


def _all_in(reps: _Replicas, job: FTJob, replicas: int) -> bool:
    """Every group alive and, since its last start, seen in a committed step."""
    lines = reps.snapshot()
    for r in range(replicas):
        if reps.procs[r].poll() is not None:
            return False
        since = max(t for t, g in job.starts if g == r)
        if not any(g == r and t > since and " commit 1 " in text for t, g, text in lines):
            return False
    return True


def _check(reps: _Replicas, deadline: float, work: Path, replicas: int) -> None:
    if time.monotonic() > deadline:
        tail = "\n".join(t for _, _, t in reps.snapshot()[-20:])
        raise TimeoutError(f"torchft job in {work} did not finish in time; last lines:\n{tail}")
    for r, proc in reps.procs.items():
        if proc.poll() not in (None, 0, -signal.SIGKILL, -signal.SIGTERM):
            err = (work / f"replica{r}.stderr").read_text()[-3000:]
            raise RuntimeError(
                f"replica {r} exited with {proc.returncode}; its stderr ends:\n{err}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    """Run a job (``--help``); copy a finished group's weights to ``OUT/final.pt``; 0 if done."""
    p = argparse.ArgumentParser(prog="python -m refimpl.demos.torchft_job")
    p.add_argument("--out", required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=240.0)
    args = p.parse_args(argv)
    job = run_ft_job(
        args.out,
        replicas=args.replicas,
        steps=args.steps,
        step_sleep=args.step_sleep,
        ckpt_dir=args.ckpt_dir,
        save_every=args.save_every,
        timeout_s=args.timeout,
        echo=True,
    )
    done = sorted(Path(args.out).glob("replica*.pt"))
    if not done:
        print(f"no replica wrote its final weights under {args.out}", file=sys.stderr)
        return 1
    shutil.copyfile(done[0], Path(args.out) / "final.pt")
    print(f"job done: {job.steps} steps, final weights from {done[0].name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
