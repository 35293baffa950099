"""Helpers shared by the torchft tests (test_torchft_job, test_torchft_replica)."""

from __future__ import annotations

import os
from pathlib import Path


def replicas_running(out: Path) -> list[int]:
    """Pids of processes whose command line names this job's output directory."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"refimpl.demos.torchft_replica" in cmd and str(out).encode() in cmd:
                found.append(int(entry))
    return found
