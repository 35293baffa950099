"""The order in which `make test` hands files to its two pytest-xdist workers.

``make test`` runs each file (a notebook, a test module) as one unit on one worker
(``--dist loadfile --no-loadscope-reorder``). Units are handed out in collection order, so the
longest go first: the short ones then fill in at the end on whichever worker frees up, and
neither core sits idle while the other finishes a two-minute file (the longest-first rule for
scheduling jobs on identical machines). Without this, pytest-xdist orders files by their number
of tests, which puts files of a few long torchrun jobs last.

It also checks that a run leaves the repository as it found it: a chapter that writes a figure
into ``book/`` or a test that leaves a file behind fails the run (a reader's run must never
dirty the clone; ``git status --porcelain`` is compared before and after).

``_SECONDS`` is what each file took in one ``make test`` on the 2-core machine (``--durations``),
rounded; a file not listed counts as ``_DEFAULT``. A stale entry only costs balance, never
correctness: refresh it when a file's time changes by much.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

from refimpl._system import proc

ROOT = Path(__file__).resolve().parent.parent

_DEFAULT = 5
_SECONDS = {
    "notebooks/10_fault_tolerant_training.ipynb": 320,
    "tests/test_chaos_styles.py": 110,
    "tests/test_train.py": 150,
    "notebooks/11_how_often_and_at_scale.ipynb": 125,
    "tests/demos/test_chaos_trainers.py": 89,
    "tests/demos/test_reader_trainer.py": 34,
    "tests/demos/test_two_writers.py": 10,
    "tests/test_dirlock.py": 85,
    "notebooks/12_porting_an_existing_script.ipynb": 150,
    "tests/test_launch.py": 95,
    "tests/test_chaos.py": 71,
    "tests/test_preemption.py": 70,
    "notebooks/04_barriers_rank0_saving.ipynb": 48,
    "tests/test_train_sharded.py": 30,
    "tests/test_bench_paced.py": 39,  # measured at load average 12 on 2 cores
    "tests/test_hostile_entries.py": 35,
    "tests/test_sharded_async_exit.py": 35,
    "tests/test_train_flags.py": 29,
    "tests/test_train_restorable.py": 29,
    "notebooks/05_atomic_saves.ipynb": 27,
    "notebooks/13_training_that_doesnt_stop.ipynb": 25,
    "tests/demos/test_porting_traps.py": 25,
    "tests/demos/test_porting_accel.py": 15,
    "notebooks/02_ddp_from_the_inside.ipynb": 21,
    "tests/test_sync.py": 20,
    "tests/test_special_files.py": 19,
    "notebooks/07_multi_dataset_sync.ipynb": 19,
    "tests/demos/test_torchft_job.py": 17,
    "notebooks/03_buckets_and_hooks.ipynb": 16,
    "tests/test_collectives.py": 15,
    "tests/test_train_watchdog.py": 14,
    "tests/test_bench_save.py": 12,
    "notebooks/01_processes_ranks_collectives.ipynb": 11,
    "notebooks/06_checkpoint_exact_resume.ipynb": 11,
    "notebooks/09_async_saves.ipynb": 11,
    "tests/demos/test_multitask.py": 11,
    "tests/test_bench_reshard.py": 10,
    "notebooks/08_sharded_checkpoints.ipynb": 10,
    "tests/demos/test_ddp_details.py": 9,
    "tests/test_checkpoint.py": 9,
    "tests/demos/test_ddp_profile.py": 9,
    "tests/demos/test_faults.py": 9,
    "tests/test_guard.py": 8,
    "tests/demos/test_hangs.py": 7,
    "tests/demos/test_chaos_runs.py": 7,
    "tests/demos/test_rpc.py": 6,
    "tests/test_ddp.py": 6,
    "tests/test_metrics.py": 6,
}


# Files that mostly wait (for a timeout, a stall to be noticed, a restart's back-off) and use
# little CPU: with three or more workers, the last worker takes only these, so it fills the
# time the two cores would otherwise sit idle without a third CPU-heavy file competing with
# the two that run (chapter 1's measured shapes and the elastic runs' heartbeats fail when
# three heavy files share two cores). Chosen from ``REFIMPL_TEST_COST`` runs: CPU at most
# about 0.4 of the file's wall time.
_LIGHT: frozenset[str] = frozenset(
    {  # CPU seconds over wall seconds, one process at load average 6-9
        "tests/test_launch.py",  # 0.19
        "tests/test_chaos.py",  # 0.15
        "tests/test_dirlock.py",  # 0.36
        "tests/test_preemption.py",  # 0.40
        "tests/test_sharded_async_exit.py",  # 0.39
        "tests/test_hostile_entries.py",  # 0.39
        "tests/test_train_restorable.py",  # 0.37
        "tests/test_train_flags.py",  # 0.35
        "tests/test_sync.py",  # 0.10
        "tests/test_collectives.py",  # 0.30
        "tests/test_train_watchdog.py",  # 0.32
        "tests/test_guard.py",  # 0.31
    }
)


def expected_seconds(nodeid: str) -> int:
    """The time a test's file is expected to take, from its node id (``path::name``)."""
    return _SECONDS.get(nodeid.split("::", 1)[0], _DEFAULT)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A stable sort: the tests (cells) of one file keep their order.
    items.sort(key=lambda item: -expected_seconds(item.nodeid))


class _LightLaneScheduling(LoadFileScheduling):
    """``--dist loadfile`` whose last worker takes the files in ``_LIGHT``, then short ones.

    The other workers take any file, in collection order (longest first); the last one takes
    the first light file still queued, then the first short test file (expected 12 s or less,
    never a chapter: those assert measured shapes), or waits (idle, not shut down) until the
    run ends. Without the short files it sat idle for the last 330 s of a 760 s run.
    """

    def _light_lane(self, node: WorkerController) -> bool:
        return self.numnodes > 2 and node.gateway.id == f"gw{self.numnodes - 1}"

    def _assign_work_unit(self, node: WorkerController) -> None:
        if self._light_lane(node):
            scope = next((s for s in self.workqueue if s in _LIGHT), None)
            if scope is None:  # then the short test files of the tail, never a chapter
                scope = next(
                    (
                        s
                        for s in self.workqueue
                        if not s.endswith(".ipynb") and _SECONDS.get(s, _DEFAULT) <= 12
                    ),
                    None,
                )
            if scope is None:
                return
            work_unit = self.workqueue.pop(scope)
        else:
            scope, work_unit = self.workqueue.popitem(last=False)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some(
            [collection.index(nodeid) for nodeid, done in work_unit.items() if not done]
        )


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return _LightLaneScheduling(config, log)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _live_descendant_ticks(pid: int) -> int:
    """CPU clock ticks of ``pid``'s live children and of everything below them, from /proc.

    A live child's own time and the time of the children it reaped are in its ``stat``
    (utime, stime, cutime, cstime); its live children are counted by recursion. This is what
    the worker's own totals miss: a notebook's kernel reaps the torchrun jobs its cells start
    and lives until the notebook ends, and the fork server of `refimpl.launch.spawn` reaps the
    ranks and outlives every test.
    """
    ticks = 0
    try:
        tasks = [task.name for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return 0
    for task in tasks:
        try:
            children = [int(c) for c in proc.read(pid, f"task/{task}/children").split()]
        except (OSError, ValueError):
            continue
        for child in children:
            try:
                fields = proc.stat_fields(proc.read(child, "stat"))
            except OSError:
                continue
            ticks += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
            ticks += _live_descendant_ticks(child)
    return ticks


def _cpu_seconds() -> float:
    """CPU time of this process, of every child it (or they, recursively) reaped, and of its
    live children and their descendants."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = _live_descendant_ticks(os.getpid()) / _CLOCK_TICKS
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + live


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``REFIMPL_TEST_COST=FILE``, append each test's wall and CPU seconds to FILE.

    One JSON line per test (``{"worker", "start_s", "nodeid", "wall_s", "cpu_s"}``, start on
    the monotonic clock, so a run's lanes can be drawn on one timeline); CPU counts the worker and
    every process it started (torchrun, its ranks, a notebook's kernel and its jobs), which is
    what ``_SECONDS`` and ``_LIGHT`` below are chosen from.
    """
    out = os.environ.get("REFIMPL_TEST_COST")
    if not out:
        yield
        return
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield
    row = {
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "start_s": round(wall, 3),
        "nodeid": item.nodeid,
        "wall_s": round(time.monotonic() - wall, 3),
        "cpu_s": round(_cpu_seconds() - cpu, 3),
    }
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _git_status() -> set[str] | None:
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(done.stdout.splitlines()) if done.returncode == 0 else None  # not a clone: skip


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        session.config.stash[_STATUS] = _git_status()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_STATUS, None)
    if before is None or hasattr(session.config, "workerinput"):
        return
    after = _git_status()
    new = sorted((after or set()) - before)
    if new:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (
            "the run changed the repository (chapters and tests must write under a temporary "
            "directory):\n" + "\n".join(f"  {line}" for line in new)
        )
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(message, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_STATUS = pytest.StashKey[set[str] | None]()
