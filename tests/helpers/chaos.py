"""Helpers shared by the kill-test tests (test_chaos, test_chaos_trainers)."""

from __future__ import annotations

import os
from pathlib import Path


def tagged_pids(tag: str) -> list[int]:
    """Pids of live processes whose environment carries CHAOS_TEST_TAG=tag."""
    needle = f"CHAOS_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            found.append(int(entry))
    return found
