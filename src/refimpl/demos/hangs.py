"""Chapter 4's hang toolbox: how long a rank waits for a peer that failed, what a gloo group
costs in connections, and how to look inside a hung rank.

`peer_failure_worker` makes a peer die or carry on without the collective and notes how long
the waiting rank sat; `gloo_connections_worker` counts the sockets one more gloo group opens;
`spy_on_a_stuck_job` runs a job with one rank stuck in a read and runs ``py-spy dump`` on
every rank while it hangs, and `worker_frames` reduces a py-spy or faulthandler dump to the
worker's frames so a notebook can show (and a test compare) them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch.distributed as dist

from refimpl.demos.sync import _line_up, short_error

__all__ = [
    "gloo_connections_worker",
    "peer_failure_worker",
    "read_peer_failure",
    "spy_on_a_stuck_job",
    "stuck_rank_worker",
    "worker_frames",
]


def _note(path: Path, **values: Any) -> None:
    path.write_text(json.dumps(values))  # read after the job, even if this rank was killed


def peer_failure_worker(log_dir: str, how: str, carry_on_s: float) -> str:
    """Worker (2 ranks): rank 0 waits in ``dist.barrier`` for rank 1, which fails instead.

    ``how="dies"``: rank 1's process is SIGKILLed (the OOM killer, a segfault: no cleanup).
    ``how="lives"``: rank 1 catches its error and carries on elsewhere for ``carry_on_s``
    seconds, never reaching the barrier. Both ranks note their times in ``log_dir``
    (`read_peer_failure`), which survives the launcher reporting rank 1's death. Returns
    rank 0's error.
    """
    rank = dist.get_rank()
    _line_up()
    if rank == 1:
        time.sleep(0.2)  # rank 0 is inside the barrier by now
        _note(Path(log_dir, "rank1.json"), failed_at=time.monotonic())
        if how == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            raise RuntimeError("CUDA out of memory (simulated)")
        except RuntimeError:
            time.sleep(carry_on_s)  # logs it, skips the batch, ... but no barrier
        return "carried on"
    entered = time.monotonic()
    try:
        dist.barrier()
        error = "passed"
    except RuntimeError as exc:
        error = short_error(exc)
    _note(Path(log_dir, "rank0.json"), entered=entered, error_at=time.monotonic(), error=error)
    return error


def read_peer_failure(log_dir: str) -> dict[str, Any]:
    """What `peer_failure_worker` noted: rank 0's ``error``, the seconds it ``waited`` in the
    barrier, and how long ``after`` rank 1's failure its error came."""
    rank0 = json.loads(Path(log_dir, "rank0.json").read_text())
    rank1 = json.loads(Path(log_dir, "rank1.json").read_text())
    return {
        "error": rank0["error"],
        "waited": rank0["error_at"] - rank0["entered"],
        "after": rank0["error_at"] - rank1["failed_at"],
    }


def _tcp_sockets() -> dict[str, str]:
    """This process's TCP sockets, inode -> state, from /proc (Linux only)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    names = {"01": "established", "0A": "listening"}
    found = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[9] in inodes:
                    found[cols[9]] = names.get(cols[3], cols[3])
    return found


def gloo_connections_worker() -> dict[str, int]:
    """Worker: the TCP sockets this rank opens when every rank creates one more gloo group."""
    before = _tcp_sockets()
    group = dist.new_group(backend="gloo")
    opened = Counter(state for inode, state in _tcp_sockets().items() if inode not in before)
    dist.barrier(group=group)
    return {state: opened[state] for state in ("established", "listening")}


def _read_next_batch(stuck_s: float) -> None:
    """Stands in for a read that never returns: a dead NFS server, a wedged loader worker."""
    time.sleep(stuck_s)


def stuck_rank_worker(directory: str, stuck_rank: int, stuck_s: float) -> int:
    """Worker: ``stuck_rank`` hangs in `_read_next_batch`; the others wait in ``dist.barrier``.

    Each rank first writes its pid to ``directory/rankN.pid``, so a tool can find it.
    """
    rank = dist.get_rank()
    _line_up()
    Path(directory, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == stuck_rank:
        _read_next_batch(stuck_s)
    dist.barrier()
    return rank


def worker_frames(dump: str) -> list[str]:
    """The worker's frames, innermost first, from a py-spy or faulthandler dump of a rank.

    Only the thread that runs the worker counts (its stack holds ``bootstrap``), down to the
    worker function; a dump that is already just those frames (the launcher's ``stacks``)
    is read whole. Each frame becomes ``function (package/file.py)``: no line numbers or
    install prefixes, which change with every edit and every machine.
    """
    pattern = re.compile(
        r'^\s*(?:File "(?P<ff>[^"]+)", line \d+ in (?P<fn>\S+)'
        r"|(?P<sn>\S+) \((?P<sf>[^():]+)(?::\d+)?\))\s*$"
    )
    dump = re.sub(r"\x1b\[[0-9;]*m", "", dump)  # py-spy colours its output on some terminals
    threads = []
    for block in re.split(r"\n(?=(?:Current thread|Thread|Process) )", dump):
        frames = []
        for line in block.splitlines():
            m = pattern.match(line)
            if m:
                path = re.sub(r"^.*?(site-packages|/src)/", "", m["ff"] or m["sf"])
                frames.append(f"{m['fn'] or m['sn']} ({path})")
        names = [frame.split(" (")[0] for frame in frames]
        if "bootstrap" in names:
            return frames[: names.index("bootstrap")]
        threads.append(frames)
    return threads[0] if len(threads) == 1 else []


def spy_on_a_stuck_job(
    directory: str, *, world_size: int = 2, pg_timeout_s: float = 4.0, py_spy: str | None = None
) -> tuple[dict[int, str], BaseException | None]:
    """Run `stuck_rank_worker` (the last rank stuck) and ``py-spy dump`` every rank mid-hang.

    The job runs in a thread of this process; once every rank has written its pid, each is
    dumped with py-spy (found next to this Python, else on PATH). Returns ``({rank: py-spy's
    output, or its error}, the job's error)``; the error is the launcher's `WorkerError`,
    whose ``stacks`` hold the faulthandler stacks it collected itself.
    """
    from refimpl.launch import spawn

    tool = py_spy or shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
    failure: list[BaseException] = []

    def job() -> None:
        try:
            spawn(
                stuck_rank_worker,
                world_size,
                directory,
                world_size - 1,
                60.0,
                timeout_s=60,
                pg_timeout_s=pg_timeout_s,
            )
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=job, name="stuck-job")
    thread.start()
    pid_files = [Path(directory, f"rank{r}.pid") for r in range(world_size)]
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in pid_files) and thread.is_alive():
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 is in the barrier now, the stuck rank in its read
    dumps: dict[int, str] = {}
    for rank, pid_file in enumerate(pid_files):
        try:
            done = subprocess.run(
                [tool, "dump", "--pid", pid_file.read_text()],
                capture_output=True,
                text=True,
                timeout=30,
            )
            dumps[rank] = done.stdout if done.returncode == 0 else done.stderr.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            dumps[rank] = f"{type(exc).__name__}: {exc}"
    thread.join()
    return dumps, (failure[0] if failure else None)
