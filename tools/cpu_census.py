"""Where a command's CPU goes: run it, sample /proc, print CPU by process kind and how busy
the cores were.

    python tools/cpu_census.py -- make test
    python tools/cpu_census.py --json census.json --top 20 -- make chapter N=10

Every ``--every`` seconds (0.5) it reads ``/proc/stat`` (the whole machine) and the CPU time
(utime + stime) of every process on the machine, keyed by pid and start time, so a pid used
twice counts twice. A process started during the run counts with its last sampled time, under
the command line it had when last seen (a child read between ``fork`` and ``exec`` gets its
own line at the next sample). What a process used in its last ``--every`` seconds is missed:
the totals are a floor.

It shows what ``time`` cannot: ``time`` counts the children a command waited for, not the
processes that outlived their parent and were adopted by init, nor how busy the machine was.
When the cores are busy nearly all the run, the wall time is the CPU time over the cores, and
only less CPU makes the command faster; scheduling (more or fewer pytest workers) cannot.

Linux only (``/proc``). The exit status is the command's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")
_IDLE, _IOWAIT = 3, 4  # columns of the "cpu" line of /proc/stat after its name


@dataclass
class Census:
    """What the sampler saw: the machine's CPU columns at the first and last sample, and
    each process started during the run as ``(pid, start) -> [command line, cpu seconds]``."""

    first: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)
    seconds: float = 0.0
    started: dict[tuple[int, int], list[str | float]] = field(default_factory=dict)

    def _ticks(self) -> tuple[int, int]:
        """Clock ticks of all cores between the samples: (all, not idle)."""
        spent = [b - a for a, b in zip(self.first, self.last, strict=True)]
        return sum(spent), sum(spent) - spent[_IDLE] - spent[_IOWAIT]

    def busy(self) -> float:
        """The share of all cores' time that was not idle (iowait counts as idle)."""
        total, busy = self._ticks()
        return busy / total if total else 0.0

    def machine_cpu_seconds(self) -> float:
        """CPU seconds the whole machine spent between the samples, every process included."""
        return self._ticks()[1] / _TICKS


def _machine_columns() -> list[int]:
    with open("/proc/stat", encoding="ascii") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def _processes() -> dict[tuple[int, int], tuple[str, float]]:
    """Every live process: (pid, start tick) -> (command line, utime + stime in seconds)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().rstrip(b"\0").split(b"\0")
        except (OSError, IndexError):
            continue  # it ended while we read it
        cmd = " ".join(a.decode(errors="replace") for a in argv)
        found[(int(entry), int(fields[19]))] = (cmd, (int(fields[11]) + int(fields[12])) / _TICKS)
    return found


def kind(cmd: str) -> str:
    """A short name for a command line: ``torchrun``, ``python -m MODULE``, ``python SCRIPT``,
    ``python -c``, or the program's name."""
    argv = cmd.split()
    if not argv:
        return "(no command line)"
    prog = Path(argv[0]).name
    if not prog.startswith("python"):
        return prog
    args = [a for a in argv[1:] if a not in ("-u", "-B", "-I", "-E", "-s")]
    while args[:1] == ["-X"] or (args[:1] and args[0].startswith("-X")):
        args = args[2:] if args[0] == "-X" else args[1:]
    if not args:
        return "python"
    if args[0] == "-m" and len(args) > 1:
        return f"python -m {args[1]}"
    if args[0] == "-c":
        return "python -c"
    name = Path(args[0]).name
    return name if name in ("torchrun", "jupyter-book", "mypy", "pytest") else f"python {name}"


def run(command: list[str], every: float) -> tuple[int, Census]:
    """Run ``command`` to its end while sampling; return its exit status and the census."""
    census = Census(first=_machine_columns())
    before = set(_processes())
    done = threading.Event()

    def sample() -> None:
        while True:
            for key, (cmd, cpu) in _processes().items():
                if key not in before:
                    known = census.started.get(key)
                    # an ended process not yet reaped (a zombie) has no command line left
                    census.started[key] = [cmd or (str(known[0]) if known else ""), cpu]
            census.last = _machine_columns()
            if done.wait(every):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    start = time.monotonic()
    sampler.start()
    status = subprocess.call(command)
    census.seconds = time.monotonic() - start
    done.set()
    sampler.join()
    return status, census


def report(census: Census, top: int) -> str:
    by_kind: dict[str, list[float]] = defaultdict(list)
    for cmd, cpu in census.started.values():
        by_kind[kind(str(cmd))].append(float(cpu))
    counted = sum(sum(v) for v in by_kind.values())
    lines = [
        f"wall {census.seconds:.0f} s; cores busy {census.busy():.0%} of the time "
        f"({census.machine_cpu_seconds():.0f} CPU-s on the whole machine, "
        f"{os.cpu_count()} cores); processes started: {len(census.started)}, "
        f"{counted:.0f} CPU-s",
        f"{'CPU-s':>8} {'share':>6} {'count':>6} {'median':>7}  kind",
    ]
    ranked = sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))
    for name, cpus in ranked[:top]:
        lines.append(
            f"{sum(cpus):8.1f} {sum(cpus) / max(counted, 1e-9):6.1%} {len(cpus):6d} "
            f"{statistics.median(cpus):7.2f}  {name}"
        )
    if len(ranked) > top:
        rest = [c for _, cpus in ranked[top:] for c in cpus]
        lines.append(f"{sum(rest):8.1f} {'':6} {len(rest):6d} {'':7}  ({len(ranked) - top} more)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--top", type=int, default=25, help="kinds to list")
    parser.add_argument("--json", type=Path, help="write every process's line and CPU here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- make test")
    if not os.path.isdir("/proc"):
        parser.error("reads /proc: Linux only")
    if args.every <= 0:
        parser.error("--every must be above 0")
    status, census = run(command, args.every)
    print("--- cpu_census ---\n" + report(census, args.top), file=sys.stderr)
    if args.json:
        rows = [[pid, cmd, cpu] for (pid, _), (cmd, cpu) in census.started.items()]
        args.json.write_text(
            json.dumps({"seconds": census.seconds, "busy": census.busy(), "processes": rows})
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
