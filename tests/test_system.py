"""refimpl._system.proc: the one place the library reads /proc (Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from refimpl._system import proc

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")


def test_stat_fields_skip_a_command_name_with_spaces_and_parentheses() -> None:
    stat = "42 (a) b (c) S 7 42 42 0 -1 4194560"
    assert proc.stat_fields(stat)[:2] == ["S", "7"]


def test_this_process_is_running_and_a_reaped_one_is_gone() -> None:
    assert proc.pid_alive(os.getpid()) and proc.state(os.getpid()) in ("R", "S")
    assert proc.state_and_parent(os.getpid()) == (proc.state(os.getpid()), os.getppid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names nothing now
    assert not proc.pid_alive(child.pid)
    assert proc.state(child.pid) is None and proc.state_and_parent(child.pid) is None
    assert proc.environ(child.pid) == []


def test_a_zombie_exists_but_its_state_says_so() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while proc.state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)  # exited, not yet reaped
    assert proc.state(child.pid) == "Z" and proc.pid_alive(child.pid)
    child.wait()


def test_start_time_is_when_this_process_began() -> None:
    assert proc.start_time() <= time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert proc.start_time(child.pid) >= proc.start_time() - 0.02  # one clock tick
    finally:
        child.kill()
        child.wait()


def test_pids_with_env_finds_a_process_by_its_marker_and_not_this_one() -> None:
    entry = f"REFIMPL_TEST_MARK={uuid.uuid4().hex}"
    name, value = entry.split("=")
    os.environ[name] = value
    try:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            deadline = time.monotonic() + 60
            while not proc.pids_with_env(entry) and time.monotonic() < deadline:
                time.sleep(0.05)  # the kernel sets a new process's environment up after exec
            assert proc.pids_with_env(entry) == [child.pid]
            assert entry.encode() in proc.environ(child.pid)
        finally:
            child.kill()
            child.wait()
    finally:
        del os.environ[name]


def test_boot_id_is_this_boots() -> None:
    assert proc.boot_id() == Path(proc.BOOT_ID_FILE).read_text().strip()
    assert proc.pid_namespace() == str(os.stat("/proc/self/ns/pid").st_ino)
