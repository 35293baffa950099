"""The launcher's contract: results in rank order, the failing rank named with its traceback,
hangs ended within the timeout, no process left behind, unspawnable functions refused early."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from workers import launch as launch_workers

from refimpl.launch import NotSpawnableError, WorkerError, WorkerTimeout, spawn


def _alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def _pids(pid_dir: Path) -> list[int]:
    return [int(p) for f in sorted(pid_dir.glob("*.pid")) for p in f.read_text().split()]


def test_results_come_back_in_rank_order() -> None:
    assert spawn(launch_workers.rank_and_sum, 3) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_world_size_one_works() -> None:
    assert spawn(launch_workers.rank_and_sum, 1) == [(0, 1, 1.0)]


def test_torchrun_environment_is_set_and_parent_env_is_passed(monkeypatch) -> None:
    monkeypatch.setenv("FROM_PARENT", "yes")
    views = spawn(launch_workers.env_view, 2)
    assert views == [
        {
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "FROM_PARENT": "yes",
        }
        for r in range(2)
    ]


def test_large_results_do_not_deadlock() -> None:
    out = spawn(launch_workers.big_result, 2, 2_000_000)
    assert [t.shape[0] for t in out] == [2_000_000, 2_000_000]
    assert out[1].sum().item() == 2_000_000.0


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_worker_error_names_its_rank_and_keeps_the_traceback(bad_rank: int) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(launch_workers.fail_on, 3, bad_rank, timeout_s=30)
    err = info.value
    assert err.rank == bad_rank
    assert f"rank {bad_rank} raised ValueError: boom on rank {bad_rank}" in str(err)
    assert isinstance(err.__cause__, ValueError)
    assert "in fail_on" in err.remote_traceback  # the worker's own frame, not the launcher's
    # The healthy ranks were stuck in a barrier; they were killed, not waited for.
    assert time.monotonic() - start < 15


def test_unpicklable_exception_still_reports_type_and_message() -> None:
    with pytest.raises(WorkerError, match=r"rank 0 raised Unpicklable: 1\+2") as info:
        spawn(launch_workers.raise_unpicklable, 1)
    assert info.value.__cause__ is None


def test_hung_worker_ends_as_timeout_and_no_process_survives(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:
        spawn(launch_workers.record_pid_then, 2, str(tmp_path), "hang", timeout_s=4)
    elapsed = time.monotonic() - start
    assert info.value.ranks == [0, 1]
    assert 4 <= elapsed < 12, elapsed
    pids = _pids(tmp_path)
    assert len(pids) == 4  # two ranks, each with a `sleep` grandchild
    time.sleep(0.2)
    assert [p for p in pids if _alive(p)] == []


def test_rank_killed_by_signal_is_named_and_everything_is_reaped(tmp_path: Path) -> None:
    with pytest.raises(WorkerError, match="rank 1 was killed by SIGKILL") as info:
        spawn(launch_workers.record_pid_then, 3, str(tmp_path), "sigkill_rank1", timeout_s=30)
    assert info.value.rank == 1
    time.sleep(0.2)
    pids = _pids(tmp_path)
    assert len(pids) == 6
    assert [p for p in pids if _alive(p)] == []


def test_exception_kills_the_other_ranks_and_their_children(tmp_path: Path) -> None:
    with pytest.raises(WorkerError, match="rank 0 raised RuntimeError: rank 0 gives up"):
        spawn(launch_workers.record_pid_then, 2, str(tmp_path), "raise_rank0", timeout_s=30)
    time.sleep(0.2)
    pids = _pids(tmp_path)
    assert len(pids) == 4
    assert [p for p in pids if _alive(p)] == []


def test_skipped_collective_ends_as_error_after_group_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(launch_workers.skip_collective_on, 2, 1, timeout_s=30, pg_timeout_s=2)
    # Rank 0 waited in all_reduce for rank 1; gloo's 2 s timeout turned the hang into an error.
    assert info.value.rank == 0
    assert time.monotonic() - start < 15


def _defined_here() -> None:
    pass


def test_functions_from_main_or_closures_are_refused_before_starting() -> None:
    def local() -> None:
        pass

    with pytest.raises(NotSpawnableError, match="defined inside another function"):
        spawn(local, 2)
    with pytest.raises(NotSpawnableError, match="lambda"):
        spawn(lambda: None, 2)
    _defined_here.__module__ = "__main__"
    with pytest.raises(NotSpawnableError, match="defined in __main__"):
        spawn(_defined_here, 2)


def test_bad_world_size_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        spawn(launch_workers.rank_and_sum, 0)


def test_init_from_env_without_torchrun_runs_as_a_world_of_one() -> None:
    """``python train.py`` (no torchrun variables) just works, alone, and says so."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "import torch, torch.distributed as dist\n"
        "from refimpl.launch import init_from_env\n"
        "info = init_from_env()\n"
        "t = torch.ones(1); dist.all_reduce(t)\n"
        "print(info.rank, info.world_size, info.backend, info.device, t.item())\n"
        "dist.destroy_process_group()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0 1 gloo cpu 1.0"
    assert "world of one" in done.stderr and "torchrun --nproc-per-node" in done.stderr


def test_init_from_env_inside_spawn_reports_position() -> None:
    from refimpl.collectives import rank_info

    before = os.environ.get("RANK")
    infos = spawn(rank_info, 2)
    assert [(i.rank, i.world_size, i.backend) for i in infos] == [(0, 2, "gloo"), (1, 2, "gloo")]
    assert all(i.device == torch.device("cpu") for i in infos)
    assert os.environ.get("RANK") == before  # the launcher never edits the parent's env


def test_rank_output_is_hidden_by_default_and_shown_in_rank_order(capfd) -> None:
    assert spawn(launch_workers.print_then_maybe_fail, 2, False) == [0, 1]
    assert "hello from rank" not in capfd.readouterr().out
    spawn(launch_workers.print_then_maybe_fail, 2, False, rank_output="show")
    lines = [x for x in capfd.readouterr().out.splitlines() if x.startswith("[rank")]
    assert lines == ["[rank 0] hello from rank 0", "[rank 1] hello from rank 1"]


def test_failing_rank_output_is_kept_on_the_error() -> None:
    with pytest.raises(WorkerError) as info:
        spawn(launch_workers.print_then_maybe_fail, 2, True)
    assert info.value.rank == 1
    assert "hello from rank 1" in info.value.output


def test_unknown_rank_output_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="rank_output"):
        spawn(launch_workers.rank_and_sum, 2, rank_output="loud")


@pytest.mark.slow
def test_launcher_killed_by_sigkill_leaves_no_rank_behind(tmp_path: Path) -> None:
    """The job's own launcher dies (OOM killer, scancel): its ranks must not live on."""
    import signal
    import subprocess
    import sys

    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from workers import launch as launch_workers\n"
        "from refimpl.launch import spawn\n"
        "spawn(launch_workers.record_pid_then, 2, sys.argv[2], 'hang', timeout_s=600)\n"
    )
    tests_dir = str(Path(__file__).parent)
    launcher = subprocess.Popen([sys.executable, "-c", script, tests_dir, str(tmp_path)])
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)  # let both ranks finish writing
    pids = _pids(tmp_path)
    assert len(pids) == 4
    assert all(_alive(p) for p in pids)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10  # each rank checks on its launcher twice a second
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []


def test_root_cause_wins_over_a_peer_wrapping_its_connection_error() -> None:
    with pytest.raises(WorkerError) as info:
        spawn(
            launch_workers.real_cause_on_rank1_wrapped_collateral_on_rank0,
            2,
            timeout_s=30,
            pg_timeout_s=10,
        )
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError)


def test_a_symptom_reported_first_waits_for_the_cause_that_reports_later() -> None:
    """A fresh-clone run named rank 1's MainProcessFailed instead of rank 0's error: rank 0
    reported more than the 1 s grace after its symptom. Symptoms alone now wait longer."""
    with pytest.raises(WorkerError) as info:
        spawn(
            launch_workers.symptom_on_rank1_then_the_cause_on_rank0_late,
            2,
            3.0,
            timeout_s=30,
            pg_timeout_s=10,
        )
    assert info.value.rank == 0, info.value
    assert isinstance(info.value.__cause__, ValueError)


# --- Issue 14: whatever a rank does, spawn ends within timeout_s with the rank named ------


def test_a_rank_killed_while_its_result_is_in_flight_never_hangs_the_launcher() -> None:
    import time

    start = time.monotonic()
    try:
        spawn(launch_workers.die_while_reporting, 2, 200, timeout_s=30)
    except WorkerError as err:
        assert err.rank == 1 and "SIGKILL" in str(err), err
    assert time.monotonic() - start < 40


@pytest.mark.slow
def test_what_ranks_print_survives_without_pythonunbuffered(tmp_path: Path) -> None:
    """Jupyter, CI and pytest give ranks a non-terminal stdout; user code does not flush."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    tests_dir = str(Path(__file__).parent)
    env["PYTHONPATH"] = tests_dir + os.pathsep + env.get("PYTHONPATH", "")
    code = (
        "from workers import launch as launch_workers\n"
        "from refimpl.launch import spawn, WorkerError\n"
        "spawn(launch_workers.print_no_flush, 2, False, rank_output={mode!r}, timeout_s=60)\n"
        "try:\n    spawn(launch_workers.print_no_flush, 2, True, timeout_s=60)\n"
        "except WorkerError as err:\n    print('FAILED RANK OUTPUT:', err.output.strip())\n"
    )
    for mode in ("show", "inherit", "hide"):
        done = subprocess.run(
            [sys.executable, "-c", code.format(mode=mode)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        if mode == "show":
            assert "[rank 0] hello from rank 0" in done.stdout
            assert "[rank 1] hello from rank 1" in done.stdout
        if mode == "inherit":
            assert "hello from rank 0" in done.stdout and "hello from rank 1" in done.stdout
        assert "FAILED RANK OUTPUT: hello from rank 1" in done.stdout, (mode, done.stdout)


def test_a_rank_can_start_dataloader_workers() -> None:
    assert spawn(launch_workers.dataloader_workers_in_a_rank, 2, timeout_s=120) == [28, 28]


def test_a_rank_killed_by_a_realtime_signal_is_named() -> None:
    with pytest.raises(WorkerError, match=r"rank 1 was killed by SIGRTMIN\+1") as info:
        spawn(launch_workers.killed_by_realtime_signal, 2, timeout_s=60)
    assert info.value.rank == 1


def test_an_unpicklable_return_value_says_what_happened() -> None:
    with pytest.raises(WorkerError, match="cannot be pickled") as info:
        spawn(launch_workers.return_unpicklable, 1, timeout_s=60)
    assert info.value.rank == 0 and "function" in str(info.value)


def test_an_exception_the_launcher_cannot_import_is_still_a_worker_error() -> None:
    with pytest.raises(WorkerError, match="cannot unpickle") as info:
        spawn(launch_workers.raise_exception_parent_cannot_import, 1, timeout_s=60)
    assert info.value.rank == 0
    # the rank's own message and traceback still reach the caller (issue 19)
    assert "rank 0 raised GhostError: a class the launcher cannot import" in str(info.value)
    assert "in raise_exception_parent_cannot_import" in info.value.remote_traceback


# --- Issue 13: name the stuck rank -------------------------------------------------------


def test_a_collective_timeout_names_the_rank_that_never_came_with_its_stack() -> None:
    with pytest.raises(WorkerError) as info:
        spawn(launch_workers.skip_collective_on, 2, 1, timeout_s=60, pg_timeout_s=2)
    err = info.value
    assert err.rank == 0  # the rank that timed out waiting
    assert list(err.stacks) == [1] and "in skip_collective_on" in err.stacks[1]
    assert "rank 1 (NOT in a collective)" in str(err)
    assert "rank(s) 1 never reached the collective that rank(s) 0 waited in" in str(err)


def test_a_job_timeout_reports_where_every_live_rank_was() -> None:
    with pytest.raises(WorkerTimeout) as info:
        spawn(launch_workers.skip_collective_on, 2, 1, timeout_s=8, pg_timeout_s=60)
    err = info.value
    assert sorted(err.stacks) == [0, 1]
    assert "all_reduce" in err.stacks[0] and "time.sleep" not in err.stacks[0]
    assert "rank 0 (waiting in a collective)" in str(err)
    assert "rank(s) 1 never reached the collective that rank(s) 0 waited in" in str(err)


def test_a_grandchild_in_a_new_session_does_not_outlive_spawn(tmp_path: Path) -> None:
    with pytest.raises(WorkerError):
        spawn(launch_workers.start_escaping_grandchild_then_fail, 2, str(tmp_path), timeout_s=60)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_running(p) for p in pids):
        assert time.monotonic() < deadline, f"new-session grandchildren alive: {pids}"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_partial_and_keyword_arguments_reach_the_worker() -> None:
    import functools

    assert spawn(launch_workers.scaled_rank, 2, 10, kwargs={"offset": 1}) == [1, 11]
    assert spawn(functools.partial(launch_workers.scaled_rank, 5, offset=2), 2) == [2, 7]
    with pytest.raises(NotSpawnableError, match=r"defined in __main__|lambda"):
        spawn(functools.partial(lambda x: x, 1), 1)


# --- issue 19: arguments checked before anything exists; the limit covers start-up ---------


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"world_size": 2.5}, "world_size"),
        ({"world_size": 0}, "world_size"),
        ({"world_size": -1}, "world_size"),
        ({"world_size": True}, "world_size"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"pg_timeout_s": 0}, "pg_timeout_s"),
        ({"pg_timeout_s": -1.0}, "pg_timeout_s"),
        ({"pg_timeout_s": float("inf")}, "pg_timeout_s"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_created(
    kwargs: dict, shown: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[type-arg]
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where spawn's run dir would go
    world_size = kwargs.pop("world_size", 2)
    with pytest.raises(ValueError, match=shown):
        spawn(launch_workers.rank_and_sum, world_size, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_the_time_limit_covers_start_up() -> None:
    spawn(launch_workers.rank_and_sum, 1)  # the fork server is up: its own start is not measured
    limit = 0.05
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match="starting"):
        spawn(launch_workers.rank_and_sum, 64, timeout_s=limit)
    elapsed = time.monotonic() - start
    # Before the fix the clock started after every rank was up: 6.2 s for 64 ranks here. The
    # slack is wide so that a loaded machine (two test workers on two cores) cannot fail it.
    assert elapsed < limit + 3.0, f"gave up after {elapsed:.2f} s, limit {limit} s"


# --- Issue 18: a restarted attempt on torchrun's shared store ------------------------------


def _attempt_env(port: int, rank: int, attempt: int) -> dict[str, str]:
    """What torchrun (torch 2.13, shared store) gives a worker of attempt ``attempt``; the
    store at ``port`` stands for the agent's, which outlives every attempt."""
    return {
        **dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"),
        **dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        **dict(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(attempt)),
    }


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_restarted_attempts_never_read_a_dead_attempts_keys(tmp_path: Path) -> None:
    """Attempts 1-5 meet on the store attempt 0 wrote to, as under torchrun; in each, one rank
    starts late, so the other finds the dead attempt's addresses there first. Whether gloo
    then connects to a dead port or both sides wait to be connected to depends on how the
    addresses compare, so a few attempts in a row are what catches it. Each worker is a new
    process forked from the launcher's fork server (torch imported, no group ever made)."""
    import multiprocessing as mp

    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from workers.launch import restarted_attempt

    from refimpl.launch._spawn import _forkserver_preload

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_forkserver_preload())
    agent_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for attempt in range(6):
        late = attempt % 2 if attempt else -1
        results = [tmp_path / f"attempt{attempt}.rank{r}" for r in range(2)]
        procs = [
            ctx.Process(
                target=restarted_attempt,
                args=(
                    _attempt_env(agent_store.port, r, attempt),
                    2.0 if r == late else 0.0,
                    str(results[r]),
                ),
            )
            for r in range(2)
        ]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                p.kill()
        for r, (p, result) in enumerate(zip(procs, results, strict=True)):
            said = result.read_text() if result.exists() else "(nothing)"
            assert (p.exitcode, said) == (0, "2"), f"attempt {attempt} rank {r}: {said}"


@pytest.mark.timeout(30)
def test_an_attempt_whose_rank_0_never_comes_ends_within_the_init_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from refimpl.launch._torchrun import AttemptStoreError, attempt_store

    agent_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agent_store.set("refimpl/job/attempt", "dead0")  # a previous attempt's rank 0, its answer
    agent_store.set("refimpl/dead0/go/1", "not-yours")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    start = time.monotonic()
    with pytest.raises(AttemptStoreError, match=r"rank 1: no rank 0 of this attempt"):
        attempt_store(1, 2, timeout_s=2)
    assert time.monotonic() - start < 10


_TWO_JOBS_RANK = """
import sys
from refimpl.launch._torchrun import attempt_store
rank, job = int(sys.argv[1]), sys.argv[2]
store = attempt_store(rank, 2, timeout_s=30)
store.set(f"job/{rank}", job)
print(store.get(f"job/{1 - rank}").decode(), flush=True)  # my peer's job
"""


@pytest.mark.timeout(120)
def test_two_jobs_on_one_store_each_meet_their_own_ranks() -> None:
    """Two torchrun jobs whose agents share one store (one rendezvous endpoint): both rank 0s
    publish a token before either rank 1 looks. Before, the token had one key for every job:
    both rank 1s read the second job's token, one joined the other job's group, and the rest
    waited out the timeout. Now each token is under its job's run id."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}

    def start(rank: int, job: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-c", _TWO_JOBS_RANK, str(rank), job]
        job_env = {**env, "TORCHELASTIC_RUN_ID": job}
        return subprocess.Popen(
            cmd, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    procs = {}
    try:
        before = store.num_keys()
        for job in ("jobA", "jobB"):  # each rank 0 first, and its token in the store
            procs[0, job] = start(0, job)
            deadline = time.monotonic() + 60
            while store.num_keys() == before and time.monotonic() < deadline:
                time.sleep(0.05)
            before = store.num_keys()
        for job in ("jobA", "jobB"):
            procs[1, job] = start(1, job)
        done = {key: p.communicate(timeout=90) for key, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    for (rank, job), (out, err) in done.items():
        assert (procs[rank, job].returncode, out) == (0, f"{job}\n"), (rank, job, err[-2000:])


# --- Issue 19 item 16: no rank tears its group down while a peer is still connecting ---------


@pytest.mark.timeout(60)
def test_a_rank_does_not_tear_down_while_a_peer_is_still_connecting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 lingers 1.5 s after its group is up (a stand-in for a peer slowed by load in the
    # middle of gloo's connect), then looks whether rank 0, whose worker returns at once, has
    # already begun to tear its group down. Without the wait in bootstrap it has.
    verdict = tmp_path / "verdict"
    monkeypatch.setenv("REFIMPL_TEST_SLOW_CONNECT", f"1:1.5:{verdict}")
    assert spawn(launch_workers.no_collective, 2, timeout_s=60) == [0, 1]
    assert verdict.read_text() == "intact"


@pytest.mark.timeout(120)
def test_workers_without_collectives_start_and_stop_cleanly_many_times() -> None:
    # Probabilistic (the race needs a loaded machine); the test above is the deterministic one.
    for _ in range(10):
        assert spawn(launch_workers.no_collective, 4, timeout_s=60) == [0, 1, 2, 3]


def test_fork_server_preloads_dcp_only_where_this_process_uses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed.checkpoint  # noqa: F401  (present: this session has sharded tests)

    from refimpl.launch._spawn import _forkserver_preload

    base = ["torch", "torch.distributed", "torch._dynamo"]
    assert _forkserver_preload() == [
        *base,
        "torch.distributed.checkpoint",
        "torch.distributed.fsdp",
        "refimpl.launch._rank",
    ]
    for name in ("torch.distributed.checkpoint", "torch.distributed.fsdp"):
        monkeypatch.delitem(sys.modules, name)  # a chapter that never shards
    assert _forkserver_preload() == [*base, "refimpl.launch._rank"]


def test_a_rank_finds_what_ddp_imports_already_imported() -> None:
    """DistributedDataParallel's constructor imports torch._dynamo (torch 2.13): a rank forked
    from the server has it, and wrapping a model imports nothing heavy again."""
    assert spawn(launch_workers.modules_imported_by_ddp, 2, timeout_s=60) == [(True, [])] * 2


# --- Issue 25 item 2: a torchrun worker whose agent is gone does not train on alone ----------

_WAITS_FOREVER = """
import time
from refimpl.launch import init_from_env
init_from_env(timeout_s=30)
print("ready", flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.mark.timeout(90)
def test_a_worker_whose_agent_is_killed_exits_within_10_s(tmp_path: Path) -> None:
    """SIGKILL the agent's process group only, as a scheduler that kills "the job" by the
    launcher's pid would: torchrun starts its workers in sessions of their own, so before
    refimpl noticed, the worker trained on alone (still alive 10 s later)."""
    import signal

    from refimpl._processes import workers

    script = tmp_path / "waits.py"
    script.write_text(_WAITS_FOREVER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = str(Path(__file__).parents[1] / "src")
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    worker = None
    try:
        assert agent.stdout is not None and agent.stderr is not None
        assert agent.stdout.readline().strip() == "ready", agent.stderr.read()
        (worker,) = workers(agent.pid).values()
        assert os.getpgid(worker) != agent.pid  # its own session: killpg leaves it alone
        os.killpg(agent.pid, signal.SIGKILL)
        killed = time.monotonic()
        while _running(worker) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        gone = time.monotonic() - killed
        assert not _running(worker), f"orphaned worker {worker} still runs {gone:.1f} s on"
        err = agent.stderr.read()
        assert f"torchrun's agent (pid {agent.pid}) is gone" in err, err[-2000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        if worker is not None and _running(worker):
            os.kill(worker, signal.SIGKILL)
        agent.wait()
