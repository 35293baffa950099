"""`refimpl.chaos`'s scenarios: what each does (one line each, for ``--help``), the signals
they send, the command of a world-size change, the watch that kills in a checkpoint write,
and the count of the samples a trainer logs."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from refimpl._processes import Action, descendants, kill_run, signal_all, split_rank, workers
from refimpl._system import proc

WHAT = {
    "kill-rank1": "SIGKILL the worker with RANK=1 at --kill-on; torchrun restarts the workers",
    "kill-rank0-save": "SIGKILL rank 0 at --save-on (a line printed as a save starts)",
    "kill-job": "SIGKILL every process of the command at --kill-on, then run it again",
    "sigterm-job": "SIGTERM every worker at --kill-on (a preemption), then run it again",
    "resize-job": "SIGKILL the job at --kill-on, rerun it with --resize-to N workers: it "
    "must finish",
    "kill-in-write": "SIGKILL the job while a file under --ckpt-dir is open for writing, "
    "then rerun",
    "rng-perturb": "no kill: reseed every worker's global RNGs at --kill-on; the same result "
    "means no scenario can catch a resume that forgets the RNG",
}
"""Every scenario, in the order `refimpl.chaos.run_chaos` runs them, with what it does."""
DEFAULT = ("kill-rank1", "kill-rank0-save", "kill-job", "sigterm-job")
RERUN = ("kill-job", "sigterm-job", "resize-job", "kill-in-write")  # the job is gone: run again
_PERTURB = "REFIMPL_CHAOS_PERTURB"
_HOOK = '''"""Installed by refimpl.chaos --perturb: on SIGUSR2, reseed the global RNGs."""
import os
import signal
import sys


def _initializing(name):
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _reseed(signum, frame):
    # The signal can land while the worker is still importing one of these modules (its
    # seed function not defined yet): try again once the import has finished.
    if any(_initializing(name) for name in ("random", "numpy", "torch")):
        import threading

        retry = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR2))
        retry.daemon = True
        retry.start()
        return
    seed = int.from_bytes(os.urandom(8), "little") >> 1
    import random

    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


if os.environ.get("REFIMPL_CHAOS_PERTURB") == "1":
    signal.signal(signal.SIGUSR2, _reseed)

import importlib.machinery
import importlib.util

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:  # the sitecustomize this one hides, if any, still runs
    if os.path.abspath(_entry or ".") == _here:
        continue
    _spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [_entry])
    if _spec is not None and _spec.loader is not None:
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
'''
_NPROC = re.compile(r"^--nproc[-_]per[-_]node(=|$)")
_SAMPLES = re.compile(r"^samples: (\d+) (\d+) ([\d,]*)\s*$")


def kill_rank(rank: int, sig: int) -> Action:
    """Send ``sig`` to the worker the launcher gave ``RANK=rank``."""

    def act(root: int, token: str) -> str | None:
        pid = workers(root, until=lambda found: rank in found).get(rank)
        if pid is None:
            return (
                f"no process with RANK={rank} among the command's descendants: is it a "
                "torchrun (or similar launcher) with at least two workers?"
            )
        signal_all([pid], sig)
        return None

    return act


def kill_job(root: int, token: str) -> str | None:
    """SIGKILL every process of the run."""
    kill_run(root, token)
    return None


def sigterm_workers(root: int, token: str) -> str | None:
    """SIGTERM every worker (a preemption notice)."""
    found = workers(root, until=bool)
    if not found:
        return "no process with RANK=... among the command's descendants: who is a worker?"
    signal_all(list(found.values()), signal.SIGTERM)
    return None


def perturb_env(hook_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """The variables that install the reseeding hook (a ``sitecustomize`` written to
    ``hook_dir``, first on ``PYTHONPATH``) in every Python process of a run."""
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(_HOOK)
    path = os.pathsep.join(p for p in (str(hook_dir), env.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, _PERTURB: "1"}


def _catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler for ``sig``."""
    return bool(proc.signals_caught(pid) >> (sig - 1) & 1)


def reseed_workers(root: int, token: str) -> str | None:
    """Send every worker SIGUSR2, which the `perturb_env` hook turns into a reseed."""
    found = workers(root, until=bool)
    if not found:
        return "no process with RANK=... among the command's descendants: who is a worker?"
    deadline = time.monotonic() + 5.0  # a worker still starting has not run the hook yet
    while (missing := [r for r, pid in found.items() if not _catches(pid, signal.SIGUSR2)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    if missing:
        return (
            f"ranks {missing} do not run chaos's reseeding hook (a sitecustomize on "
            "PYTHONPATH): started with python -S or -I, or not Python?"
        )
    signal_all(list(found.values()), signal.SIGUSR2)
    return None


def resized(cmd: Sequence[str], nproc: int) -> list[str] | None:
    """``cmd`` with its torchrun ``--nproc-per-node`` set to ``nproc``; None without one."""
    out, hit = list(cmd), False
    for i, arg in enumerate(out):
        if (m := _NPROC.match(arg)) is None:
            continue
        if m.group(1) == "=":
            out[i] = f"{arg.split('=', 1)[0]}={nproc}"
        elif i + 1 < len(out):
            out[i + 1] = str(nproc)
        hit = True
    return out if hit else None


def write_watch(ckpt_dir: Path) -> Callable[[int, str], str | None]:
    """A watch that kills the run while one of its processes holds a file under ``ckpt_dir``
    open for writing: seen, the processes are stopped (SIGSTOP), the file is seen open again
    (so the kill provably lands inside the write), then everything is killed. Returns where
    it landed, or None while no write is in progress."""
    under = ckpt_dir.resolve()

    def watch(root: int, token: str) -> str | None:
        pids = [root, *descendants(root)]
        if not any(proc.open_for_writing(pid, under) for pid in pids):
            return None
        signal_all(pids, signal.SIGSTOP)
        held = [(pid, p) for pid in pids for p in proc.open_for_writing(pid, under)]
        if not held:  # the write ended between the look and the stop: let it go on
            signal_all(pids, signal.SIGCONT)
            return None
        pid, path = held[0]
        size = path.stat().st_size if path.exists() else 0
        kill_run(root, token)
        return f"in the write of {path.relative_to(under)} ({size} bytes written; pid {pid})"

    return watch


def _samples(lines: Sequence[str]) -> list[tuple[int, list[int]]]:
    """``(step, sample ids)`` of each ``samples: RANK STEP ID,ID,...`` line."""
    out = []
    for line in lines:
        if (m := _SAMPLES.match(split_rank(line)[1])) is not None:
            out.append((int(m.group(2)), [int(i) for i in m.group(3).split(",") if i]))
    return out


def samples_check(reference: Sequence[str], killed: Sequence[str], rerun: Sequence[str]) -> str:
    """Whether a killed and resumed run trained each sample as often as the reference: the
    killed run's samples before the step the rerun resumed at, plus the rerun's, against the
    reference's. Empty when the trainer logs no ``samples:`` lines."""
    ref, again = _samples(reference), _samples(rerun)
    if not ref:
        return ""
    start = min((s for s, _ in again), default=0)
    want = Counter(i for _, ids in ref for i in ids)
    got = Counter(i for s, ids in _samples(killed) if s < start for i in ids)
    got.update(i for _, ids in again for i in ids)
    if got == want:
        once = "exactly once each" if set(want.values()) == {1} else "as often as the reference"
        return f"samples: all {len(want)} trained {once}"
    missing, extra = want - got, got - want
    parts = [
        f"{sum(c.values())} trainings {what} (e.g. {sorted(c)[:5]})"
        for c, what in ((missing, "missing"), (extra, "extra"))
        if c
    ]
    return "samples: " + ", ".join(parts)


def help_text() -> str:
    """The scenarios for ``--help``, one line each."""
    width = max(map(len, WHAT))
    return (
        "scenarios:\n"
        + "\n".join(f"  {n:<{width}}  {w}" for n, w in WHAT.items())
        + "\n\nresize-job reports how far the weights moved (no bitwise claim) and, when the "
        "trainer prints\n'samples: RANK STEP ID,ID,...' for each batch it trains, whether "
        "every sample was trained\nas often as in the reference."
    )
