"""How `make test` hands files to its three pytest-xdist workers.

``make test`` runs each file (a notebook, a test module) as one unit on one worker
(``--dist loadfile``; the files that mostly wait are one unit, see below), and units are
handed out in collection order, so the longest go first: the short ones then fill in at the
end on whichever worker frees up, and no core sits idle while a worker finishes a two-minute
file (the longest-first rule for scheduling jobs on identical machines). Without this,
pytest-xdist orders files by their number of tests, which puts files of a few long torchrun
jobs last.

Three workers on two cores, and the files that mostly *wait* (a timeout that must expire, a
rank blocked by design, a demo of a hang; `_WAITING`) are one unit: one worker runs them one
after another while the other two keep both cores busy with the files that compute (torchrun
jobs start Python, torch and DDP again in every worker). A third worker that computed too
would only make every job slower; one that waits fills the cores' idle time.

It also checks that a run leaves the repository as it found it: a chapter that writes a figure
into ``book/`` or a test that leaves a file behind fails the run (a reader's run must never
dirty the clone; ``git status --porcelain`` is compared before and after).

``_SECONDS`` is what each file took in one ``make test`` on the 2-core machine (``--durations``),
rounded; a file not listed counts as ``_DEFAULT``. A stale entry only costs balance, never
correctness: refresh it when a file's time changes by much.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

_DEFAULT = 5
_SECONDS = {
    "notebooks/10_fault_tolerant_training.ipynb": 360,
    "tests/test_train.py": 150,
    "tests/test_chaos_trainers.py": 89,
    "notebooks/11_porting_an_existing_script.ipynb": 84,
    "tests/test_launch.py": 71,
    "notebooks/04_barriers_rank0_saving.ipynb": 48,
    "tests/test_train_sharded.py": 45,
    "tests/test_multinode.py": 35,
    "tests/test_restarts.py": 28,
    "notebooks/05_atomic_saves.ipynb": 27,
    "tests/test_chaos.py": 24,
    "notebooks/02_ddp_from_the_inside.ipynb": 21,
    "tests/test_sync.py": 20,
    "tests/test_special_files.py": 19,
    "notebooks/07_multi_dataset_sync.ipynb": 19,
    "notebooks/03_buckets_and_hooks.ipynb": 16,
    "tests/test_collectives.py": 15,
    "tests/test_bench_save.py": 12,
    "notebooks/01_processes_ranks_collectives.ipynb": 11,
    "notebooks/06_checkpoint_exact_resume.ipynb": 11,
    "notebooks/09_async_saves.ipynb": 11,
    "tests/test_multitask.py": 11,
    "tests/test_bench_reshard.py": 10,
    "notebooks/08_sharded_checkpoints.ipynb": 10,
    "tests/test_ddp_details.py": 9,
    "tests/test_checkpoint.py": 9,
    "tests/test_ddp_profile.py": 9,
    "tests/test_sharded_async_exit.py": 9,
    "tests/test_faults.py": 9,
    "tests/test_guard.py": 8,
    "tests/test_hangs.py": 7,
    "tests/test_chaos_runs.py": 7,
    "tests/test_rpc.py": 6,
    "tests/test_ddp.py": 6,
    "tests/test_metrics.py": 6,
}
# Files whose wall time is mostly waiting: their processes used under a fifth of a core while
# they ran (CPU seconds of the test process and every child it reaped, over its wall time, in
# one make test). Timing-sensitive files stay out (chapter 1 times an all-reduce against a
# memcpy floor; chapter 3 and the benchmarks measure).
_WAITING = {
    "tests/test_launch.py",
    "notebooks/04_barriers_rank0_saving.ipynb",
    "tests/test_chaos.py",
    "notebooks/02_ddp_from_the_inside.ipynb",
    "tests/test_sync.py",
    "tests/test_collectives.py",
    "notebooks/07_multi_dataset_sync.ipynb",
    "tests/test_faults.py",
    "tests/test_hangs.py",
    "tests/test_desync.py",
    "tests/test_rpc.py",
}
_WAITING_GROUP = "waiting"


def expected_seconds(nodeid: str) -> int:
    """The time a test's file is expected to take, from its node id (``path::name``)."""
    return _SECONDS.get(nodeid.split("::", 1)[0], _DEFAULT)


def work_unit(nodeid: str) -> str:
    """The unit a test is handed out in: its file, or the group of files that mostly wait."""
    path = nodeid.split("::", 1)[0]
    return _WAITING_GROUP if path in _WAITING else path


def unit_seconds(nodeid: str) -> int:
    """The time a test's unit is expected to take."""
    if work_unit(nodeid) == _WAITING_GROUP:
        return sum(_SECONDS.get(path, _DEFAULT) for path in _WAITING)
    return expected_seconds(nodeid)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A stable sort: the tests (cells) of one file keep their order, and a unit's files too.
    items.sort(key=lambda item: -unit_seconds(item.nodeid))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's per-file scheduling (``--dist loadfile``), with `work_unit` as the unit.
    (``--dist loadgroup`` with ``xdist_group`` marks would say the same, but pytest-xdist 3.8
    marks a group by rewriting ``item._nodeid``, which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Units(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return _Units(config, log)


def _git_status() -> set[str] | None:
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
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
