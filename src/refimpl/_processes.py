"""A command's processes: run it, watch its lines, find and signal its workers.

Used by `refimpl.chaos` and by the multi-node demo (`refimpl.demos.multinode`), which kill
the same kind of process tree.

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

from refimpl._system import proc

MARKER = "REFIMPL_CHAOS_RUN"
"""Environment variable that every process of one run carries (its value is unique)."""
RANK_PREFIX_TEMPLATE = "[rank${rank}]:"
"""What chaos asks torchrun to put before each line it tees from a worker
(``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``); `split_rank` takes it off again."""
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")
_POLL_S = 0.2  # a torchrun worker lives for seconds (importing torch alone takes ~1 s)
_WATCH_S = 0.005  # how often a watch looks (a small checkpoint's write takes milliseconds)


def split_rank(line: str) -> tuple[int | None, str]:
    """``(rank, text)`` of a line torchrun teed with `RANK_PREFIX_TEMPLATE`; ``(None, line)``
    for any other line."""
    if (m := _RANK_PREFIX.match(line)) is None:
        return None, line
    return int(m.group(1)), line[m.end() :]


def descendants(root: int) -> list[int]:
    """Live (not zombie) descendants of ``root``, parents before their children."""
    children: dict[int, list[int]] = {}
    for pid in proc.pids():
        if (st := proc.state_and_parent(pid)) is not None and st[0] != "Z":
            children.setdefault(st[1], []).append(pid)
    out, i = list(children.get(root, [])), 0
    while i < len(out):
        out += children.get(out[i], [])
        i += 1
    return out


def _env_value(environ: list[bytes], name: bytes) -> bytes | None:
    prefix = name + b"="
    return next((item[len(prefix) :] for item in environ if item.startswith(prefix)), None)


def env_of(pid: int, name: str) -> str | None:
    """The value of ``name`` in the environment ``pid`` started with (None: unset or gone)."""
    value = _env_value(proc.environ(pid), name.encode())
    return None if value is None else value.decode(errors="replace")


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
            environ = proc.environ(pid)
            rank = _env_value(environ, b"RANK")
            if rank is None or not rank.isdigit() or (st := proc.state_and_parent(pid)) is None:
                continue
            parent = proc.environ(st[1])
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
    return proc.pids_with_env(f"{MARKER}={token}")


def signal_all(pids: Sequence[int], sig: int) -> None:
    """Send ``sig`` to each pid that is still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@dataclass
class Run:
    """One run of the command: its exit status (None: killed on a timeout), its output lines
    (stdout and stderr interleaved as printed), the line the action fired on and its index,
    the distinct rank-0 worker pids seen (one per start of the workers), seconds, why the
    action could not act, what `StallHook` found if the run stalled, and the longest silence
    (from the start to the first line, or between two lines)."""

    returncode: int | None
    lines: list[str]
    fired: str | None = None
    fired_at: int | None = None
    rank0_pids: set[int] = field(default_factory=set)
    seconds: float = 0.0
    action_error: str | None = None
    stalled: str | None = None
    max_gap_s: float = 0.0


Action = Callable[[int, str], str | None]
"""Called with the command's pid and this run's marker token when the trigger line arrives;
returns None, or why it could not act (then the run is killed)."""

Watch = Callable[[int, str], str | None]
"""Called every few milliseconds with the command's pid and marker token; returns None, or
(having acted) where the action landed, which the run keeps as its `Run.fired`."""

StallHook = Callable[[int, str], str]
"""Called with the command's pid and marker token when a run stalls, before it is killed;
returns what it found (kept as `Run.stalled`)."""


def run_once(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout_s: float,
    trigger: re.Pattern[str] | None = None,
    action: Action | None = None,
    cwd: str | None = None,
    stall_s: float | None = None,
    stall_from_start: bool = False,
    on_stall: StallHook | None = None,
    watch: Watch | None = None,
) -> Run:
    """Run ``cmd`` to its end (or ``timeout_s``); call ``action`` on the first line that
    ``trigger`` finds (in the line's text, without a torchrun rank prefix). With ``stall_s``,
    a run that prints no line for ``stall_s`` seconds after the action fired (from its start
    with ``stall_from_start``) is stalled: ``on_stall`` is called, then the run is killed.
    A ``watch`` is called every few milliseconds until it has acted (see `Watch`).
    Every process the run started is gone when this returns."""
    token = uuid.uuid4().hex
    full_env = {**env, MARKER: token, "PYTHONUNBUFFERED": "1"}  # lines arrive as printed
    start = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
        text=True,
        errors="replace",
    )
    run = Run(None, [])
    done = threading.Event()
    last_line = [start]

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            run.max_gap_s = max(run.max_gap_s, time.monotonic() - last_line[0])
            last_line[0] = time.monotonic()
            run.lines.append(line.rstrip("\n"))
            text = split_rank(run.lines[-1])[1]
            if trigger is None or run.fired is not None or not trigger.search(text):
                continue
            run.fired, run.fired_at = text, len(run.lines) - 1
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
            armed = stall_s is not None and (stall_from_start or run.fired is not None)
            if armed and time.monotonic() - last_line[0] > float(stall_s or 0):
                note = on_stall(proc.pid, token) if on_stall is not None else ""
                run.stalled = f"no output for {stall_s:g} s" + (f"; {note}" if note else "")
                kill_run(proc.pid, token)
                return

    def look() -> None:
        while watch is not None and not done.wait(_WATCH_S):
            if (what := watch(proc.pid, token)) is not None:
                run.fired, run.fired_at = what, len(run.lines) - 1
                return

    threads = [threading.Thread(target=f, daemon=True) for f in (read, poll, look)]
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
