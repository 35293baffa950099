"""`refimpl.chaos`'s process handling: run a command, watch its lines, signal its workers.

Linux only: workers are found through ``/proc``. torchrun starts each worker in a session of
its own (``start_new_session=True`` in torch.distributed.elastic.multiprocessing's
``subprocess_handler``), so killing the command's process group misses them. Two nets catch
every process a run started: the tree of descendants (``/proc/PID/stat``'s parent pid,
walked from the command), and an environment marker every descendant inherits, which still
finds a worker whose parent (torchrun) is already dead and that was re-parented to init.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "REFIMPL_CHAOS_RUN"
"""Environment variable that every process of one run carries (its value is unique)."""
_POLL_S = 0.2  # a torchrun worker lives for seconds (importing torch alone takes ~1 s)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def descendants(root: int) -> list[int]:
    """Live (not zombie) descendants of ``root``, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[0] != "Z":
            children.setdefault(st[1], []).append(int(entry))
    out, i = list(children.get(root, [])), 0
    while i < len(out):
        out += children.get(out[i], [])
        i += 1
    return out


def _env_value(environ: list[bytes], name: bytes) -> bytes | None:
    prefix = name + b"="
    return next((item[len(prefix) :] for item in environ if item.startswith(prefix)), None)


def workers(root: int, until: Callable[[dict[int, int]], bool] | None = None) -> dict[int, int]:
    """``{rank: pid}`` of the launcher's workers among the descendants of ``root``.

    A worker is a process whose ``RANK`` its parent did not give it: its value differs from
    the parent's (or the parent has none), or it carries ``TORCHELASTIC_RUN_ID`` and its
    parent does not (torchrun sets both for its workers only). A ``RANK`` that a job script
    exported (Kubernetes, SLURM, MPI) is inherited unchanged by the wrappers and the
    launcher, so they are not taken for workers; a worker's own children (data loader
    workers) inherit its ``RANK`` and run id, so they are not either. With ``until``, looks
    again for up to a second until ``until(found)``: a process inside ``execve`` shows an
    empty ``/proc/PID/environ`` for a moment (the kernel sets the new environment up after
    the old image is gone), so one look can miss a worker that exists (CI saw "no process
    with RANK=1" once, under load).
    """
    deadline = time.monotonic() + (1.0 if until is not None else 0.0)
    while True:
        found: dict[int, int] = {}
        for pid in descendants(root):
            environ = _environ(pid)
            rank = _env_value(environ, b"RANK")
            if rank is None or not rank.isdigit() or (st := _stat(pid)) is None:
                continue
            parent = _environ(st[1])
            run_id = _env_value(environ, b"TORCHELASTIC_RUN_ID")
            given = _env_value(parent, b"RANK") != rank or (
                run_id is not None and _env_value(parent, b"TORCHELASTIC_RUN_ID") is None
            )
            if given:
                found.setdefault(int(rank), pid)
        if until is None or until(found) or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def marked(token: str) -> list[int]:
    """Pids of the processes whose environment carries ``MARKER=token``."""
    needle = f"{MARKER}={token}".encode()
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and int(e) != os.getpid() and needle in _environ(int(e))]  # fmt: skip


def signal_all(pids: Sequence[int], sig: int) -> None:
    """Send ``sig`` to each pid that is still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@dataclass
class Run:
    """One run of the command: its exit status (None: killed on a timeout), its output lines
    (stdout and stderr interleaved as printed), the line the action fired on and its index,
    the distinct rank-0 worker pids seen (one per start of the workers), and seconds."""

    returncode: int | None
    lines: list[str]
    fired: str | None = None
    fired_at: int | None = None
    rank0_pids: set[int] = field(default_factory=set)
    seconds: float = 0.0
    action_error: str | None = None


Action = Callable[[int, str], str | None]
"""Called with the command's pid and this run's marker token when the trigger line arrives;
returns None, or why it could not act (then the run is killed)."""


def run_once(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout_s: float,
    trigger: re.Pattern[str] | None = None,
    action: Action | None = None,
    cwd: str | None = None,
) -> Run:
    """Run ``cmd`` to its end (or ``timeout_s``); call ``action`` on the first line that
    ``trigger`` finds. Every process the run started is gone when this returns."""
    token = uuid.uuid4().hex
    full_env = {**env, MARKER: token, "PYTHONUNBUFFERED": "1"}  # lines arrive as printed
    start = time.monotonic()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=full_env, cwd=cwd, start_new_session=True,
                            text=True, errors="replace")  # fmt: skip
    run = Run(None, [])
    done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            run.lines.append(line.rstrip("\n"))
            if trigger is None or run.fired is not None or not trigger.search(line):
                continue
            run.fired, run.fired_at = line.rstrip("\n"), len(run.lines) - 1
            if proc.returncode is not None:  # ended and reaped: its pid may be another's now
                continue
            if action is not None and (why := action(proc.pid, token)) is not None:
                run.action_error = why
                kill_run(proc.pid, token)

    def poll() -> None:  # one rank-0 pid per start of the workers: counts restarts
        while not done.wait(_POLL_S):
            with contextlib.suppress(OSError):
                if (pid := workers(proc.pid).get(0)) is not None:
                    run.rank0_pids.add(pid)

    threads = [threading.Thread(target=f, daemon=True) for f in (read, poll)]
    for t in threads:
        t.start()
    try:
        run.returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        done.set()
        if run.returncode is None:  # still running: its pid is still its own
            kill_run(proc.pid, token)
        else:  # exited and reaped, its pid free for reuse: only the marker is safe to follow
            signal_all(marked(token), signal.SIGKILL)  # orphans that outlived the command
        proc.wait()
        for t in threads:
            t.join(timeout=5)
        # A reader still blocked means a process that escaped every net holds the pipe open;
        # closing the pipe would wait for that read, so the thread is left (a daemon) instead.
        if proc.stdout is not None and not threads[0].is_alive():
            proc.stdout.close()
    run.seconds = time.monotonic() - start
    return run


def kill_run(root: int, token: str) -> None:
    """SIGKILL the command, its process group, its descendants and every marked process."""
    pids = [root, *descendants(root), *marked(token)]  # before a kill re-parents them to init
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(root, signal.SIGKILL)
    signal_all(pids, signal.SIGKILL)
