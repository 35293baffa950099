"""Facts about processes, from ``kill(pid, 0)`` and ``/proc`` (Linux).

Every reader returns None (or an empty answer) when ``/proc`` cannot tell: the process is
gone, it belongs to someone else, or this is not Linux. ``pid`` may be ``"self"``.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

__all__ = [
    "BOOT_ID_FILE",
    "boot_id",
    "environ",
    "open_for_writing",
    "pid_alive",
    "pid_namespace",
    "pids",
    "pids_with_env",
    "read",
    "signals_caught",
    "start_time",
    "stat_fields",
    "state",
    "state_and_parent",
]

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
"""A random id the kernel draws at each boot: two readings differ across machines and reboots."""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (``kill(pid, 0)``); a zombie and another user's
    process count as existing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read(pid: int | str, name: str) -> str:
    """The text of ``/proc/PID/NAME`` (``stat``, ``status``...). Raises OSError when it cannot
    be read (the process is gone, or not Linux)."""
    return Path(f"/proc/{pid}/{name}").read_text()


def stat_fields(stat: str) -> list[str]:
    """The fields of a ``/proc/PID/stat`` text after the command name, so ``[0]`` is the state
    (field 3 in proc(5)), ``[1]`` the parent pid, ``[19]`` the start time in clock ticks. The
    name, in parentheses, may hold spaces and parentheses: it ends at the last ``)``."""
    return stat.rsplit(")", 1)[-1].split()


def state(pid: int | str) -> str | None:
    """The state letter of ``pid`` (``R``, ``S``, ``Z`` for a zombie...), or None when
    ``/proc/PID/stat`` cannot be read."""
    try:
        return stat_fields(read(pid, "stat"))[0]
    except (OSError, IndexError):
        return None


def state_and_parent(pid: int | str) -> tuple[str, int] | None:
    """``(state, parent pid)`` of ``pid``, or None when it is gone."""
    try:
        fields = stat_fields(read(pid, "stat"))
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def start_time(pid: int | str = "self") -> float:
    """When ``pid`` was created (Unix time, to the kernel's clock tick, 10 ms): field 22 of
    ``/proc/PID/stat``, in ticks since boot. Raises OSError off Linux or for a gone pid."""
    ticks = int(stat_fields(read(pid, "stat"))[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def pids() -> list[int]:
    """The pids ``/proc`` lists (empty when there is no ``/proc``)."""
    try:
        return [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def environ(pid: int | str) -> list[bytes]:
    """The ``NAME=value`` entries ``pid`` started with (``/proc/PID/environ``); empty when it
    cannot be read (gone, another user's, or a process so new that the kernel has not set
    its environment up yet)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def pids_with_env(entry: str) -> list[int]:
    """Pids, other than this process, whose environment holds exactly ``entry``
    (``"NAME=value"``): how a job's processes are found after they left its process group."""
    needle = entry.encode()
    return [p for p in pids() if p != os.getpid() and needle in environ(p)]


def signals_caught(pid: int | str) -> int:
    """The mask of signals ``pid`` has a handler for (``SigCgt`` in ``/proc/PID/status``; bit
    ``sig - 1`` for signal ``sig``); 0 when it cannot be read."""
    try:
        status = read(pid, "status")
    except OSError:
        return 0
    mask = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), "0")
    return int(mask, 16)


def open_for_writing(pid: int | str, under: Path) -> list[Path]:
    """Files under ``under`` that ``pid`` holds open for writing (``/proc/PID/fd`` and
    ``fdinfo``'s flags); empty when they cannot be read."""
    found = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = Path(os.readlink(f"/proc/{pid}/fd/{fd}"))
            flags = read(pid, f"fdinfo/{fd}").split("flags:", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if int(flags, 8) & (os.O_WRONLY | os.O_RDWR) and target.is_relative_to(under):
            found.append(target)
    return found


def boot_id() -> str | None:
    """This boot's id (`BOOT_ID_FILE`, stripped), or None where it cannot be read (not
    Linux)."""
    with contextlib.suppress(OSError):
        return Path(BOOT_ID_FILE).read_text().strip()
    return None


def pid_namespace() -> str | None:
    """An id of this process's PID namespace (the inode of ``/proc/self/ns/pid``), or None:
    a pid only means something inside one namespace."""
    with contextlib.suppress(OSError):
        return str(os.stat("/proc/self/ns/pid").st_ino)
    return None
