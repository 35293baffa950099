"""Chapter 5's two jobs in one checkpoint directory: interleaved, then refused by `DirLock`.

`two_jobs` starts two real processes, job A and job B (the same job submitted twice, B a
little later), that save steps 1, 2, ... into one directory with `save_checkpoint` and
``keep_last=2``. A conductor gives them turns in a fixed order (A, A, then B and A
alternating), so the story is the same on every run: B re-saves over A's steps, A's pruning
deletes B's, and the newest step, which a restart of A would resume, is B's. With
``lock=True`` each job first takes `refimpl.dirlock.DirLock`; B is refused at its start with
the message naming A's process, and A's steps are its own.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from refimpl.checkpoint import list_checkpoints, load_checkpoint, load_latest, save_checkpoint
from refimpl.dirlock import DirLock, DirLocked

__all__ = ["TwoJobs", "two_jobs"]

KEEP_LAST = 2


@dataclass
class TwoJobs:
    """What `two_jobs` saw: one line per save (the directory after it), B's refusal if any,
    and which job wrote the step a restart resumes."""

    saves: list[str] = field(default_factory=list)
    refused: str | None = None
    refusal_names_a: bool = False
    resumed_step: int | None = None
    resumed_writer: str | None = None


def _listing(root: Path) -> str:
    """``step_N:writer`` for every step in ``root``, oldest first."""
    parts = []
    for step, step_dir in list_checkpoints(root):
        writer = load_checkpoint(step_dir, keys=["job"])["job"]
        parts.append(f"step_{step}:{writer}")
    return " ".join(parts)


def _job(name: str, root: str, steps: int, lock: bool, conn: Connection) -> None:
    """One job: take the lock (or not), then one save per turn the conductor gives."""
    held = DirLock(root, collective=False)
    if lock:
        try:
            held.acquire()
        except DirLocked as exc:
            holder = exc.holder.pid if exc.holder is not None else None
            conn.send(("refused", str(exc).replace(socket.gethostname(), "<host>"), holder))
            return
    conn.send(("ready", os.getpid(), None))
    for step in range(1, steps + 1):
        if conn.recv() != "go":
            return
        state = {"job": name, "weights": torch.full((4,), float(step))}
        save_checkpoint(root, state, step, keep_last=KEEP_LAST)
        conn.send(("saved", f"{name} saves step {step}: {_listing(Path(root))}", None))
    held.release()


def _receive(conn: Connection, timeout_s: float) -> tuple[str, object, object]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"a job did not answer within {timeout_s:g} s")
    message: tuple[str, object, object] = conn.recv()
    return message


def _turns(steps: int, lag: int) -> list[str]:
    """A's first ``lag`` saves, then B and A alternating while both have steps left, then B."""
    head = ["A"] * min(lag, steps)
    both = ["B", "A"] * (steps - len(head))
    return head + both + ["B"] * (steps - (steps - len(head)))


def two_jobs(
    root: str | os.PathLike[str], *, lock: bool, steps: int = 4, timeout_s: float = 60.0
) -> TwoJobs:
    """Run jobs A and B in ``root`` (a fresh directory) as described above; return the story."""
    ctx = mp.get_context("spawn")
    out = TwoJobs()
    conns, procs = {}, {}
    try:
        for name in ("A", "B"):  # B starts once A is running (and, with lock, holds it)
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_job, args=(name, str(root), steps, lock, theirs))
            proc.start()
            conns[name], procs[name] = mine, proc
            kind, value, holder = _receive(mine, timeout_s)
            if kind == "refused":  # A's host and pid become placeholders: the same text anywhere
                a_pid = procs["A"].pid
                out.refusal_names_a = holder == a_pid and f"pid {a_pid} " in str(value)
                out.refused = str(value).replace(f"pid {a_pid} ", "pid <A's pid> ")
                del conns[name]
        for name in _turns(steps, lag=2):
            if name not in conns:
                continue
            conns[name].send("go")
            kind, line, _ = _receive(conns[name], timeout_s)
            out.saves.append(str(line))
        found = load_latest(root)
        if found is not None:
            out.resumed_step, out.resumed_writer = found[0], str(found[1]["job"])
    finally:
        for proc in procs.values():
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return out
