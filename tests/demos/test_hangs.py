"""refimpl.demos.hangs: how long a rank waits for a failed peer (dead vs alive), what a gloo
group costs in sockets, and finding a hung rank with the launcher's stacks and py-spy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from refimpl.demos.hangs import (
    gloo_connections_worker,
    peer_failure_worker,
    read_peer_failure,
    spy_on_a_stuck_job,
    worker_frames,
)
from refimpl.launch import WorkerError, spawn


def test_a_dead_peer_fails_fast_a_live_one_waits_for_the_timeout(tmp_path: Path) -> None:
    dead, alive = tmp_path / "dead", tmp_path / "alive"
    dead.mkdir(), alive.mkdir()
    with pytest.raises(WorkerError) as info:  # a 20 s group timeout that must not matter
        spawn(peer_failure_worker, 2, str(dead), "dies", 0.0, timeout_s=40, pg_timeout_s=20)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    found = read_peer_failure(str(dead))
    assert found["error"].startswith("Connection closed by peer") and found["waited"] < 10
    errors = spawn(peer_failure_worker, 2, str(alive), "lives", 2.0, timeout_s=40, pg_timeout_s=1)
    assert errors == ["Timed out waiting 1000ms for send/recv operation to complete", "carried on"]
    assert read_peer_failure(str(alive))["waited"] >= 0.9  # it sat out the whole timeout


@pytest.mark.skipif(not os.path.isdir("/proc/self/net"), reason="counts sockets through /proc")
def test_a_gloo_group_connects_every_pair_of_ranks() -> None:
    assert (
        spawn(gloo_connections_worker, 3, timeout_s=40) == [{"established": 2, "listening": 1}] * 3
    )


def test_a_stuck_rank_is_found_by_the_launcher_and_by_py_spy(tmp_path: Path) -> None:
    dumps, err = spy_on_a_stuck_job(str(tmp_path), pg_timeout_s=3.0)
    assert isinstance(err, WorkerError) and err.rank == 0 and "Timed out" in str(err)
    # The launcher's own faulthandler stacks: where the rank that never came was.
    assert worker_frames(err.stacks[1]) == [
        "_read_next_batch (refimpl/demos/hangs.py)",
        "stuck_rank_worker (refimpl/demos/hangs.py)",
    ]
    if not worker_frames(dumps[1]):  # pragma: no cover - depends on ptrace permissions
        pytest.skip(f"py-spy could not read the rank: {dumps[1][:200]}")
    assert worker_frames(dumps[1])[0] == "_read_next_batch (refimpl/demos/hangs.py)"
    assert worker_frames(dumps[0])[0] == "barrier (torch/distributed/distributed_c10d.py)"


def test_worker_frames_reads_py_spy_and_faulthandler() -> None:
    spy = (
        'Thread \x1b[1m7\x1b[0m (idle): "MainThread"\n'
        "    barrier (torch/distributed/distributed_c10d.py:5356)\n"
        "    work (refimpl/demos/x.py:3)\n"
        "    bootstrap (refimpl/launch/_rank.py:185)\n"
        "    main (multiprocessing/forkserver.py:274)\n"
        'Thread 8 (idle): "refimpl-launcher-watch"\n'
        "    watch (refimpl/launch/_rank.py:80)\n"
    )
    assert worker_frames(spy) == [
        "barrier (torch/distributed/distributed_c10d.py)",
        "work (refimpl/demos/x.py)",
    ]
    fault = (
        "Thread 0x01 (most recent call first):\n"
        '  File "/x/lib/python3.11/threading.py", line 3 in run\n\n'
        "Current thread 0x02 (most recent call first):\n"
        '  File "/w/src/refimpl/demos/x.py", line 9 in stuck\n'
        '  File "/w/src/refimpl/launch/_rank.py", line 185 in bootstrap\n'
    )
    assert worker_frames(fault) == ["stuck (refimpl/demos/x.py)"]
    assert worker_frames("no frames here") == []
