"""refimpl.sync: the rank-0-save incident reproduced on gloo, and the barriers that fix it.
Timing claims are checked as causality (who finished before whom), never as durations."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest
from workers import sync as sync_workers

from refimpl.demos.sync import (
    Timeline,
    barrier_cost_worker,
    late_barrier_worker,
    main_process_first_worker,
    plot_timeline,
    read_timeline,
    short_error,
    straggler_worker,
    train_and_save_worker,
)
from refimpl.launch import WorkerError, WorkerTimeout, spawn
from refimpl.sync import barrier_safe, main_process_first

matplotlib.use("Agg")


def _spans(log_dir: Path, rank: int, phase: str) -> list[dict]:  # type: ignore[type-arg]
    return [s for s in read_timeline(log_dir) if s["rank"] == rank and s["phase"] == phase]


def test_helpers_are_no_ops_without_a_process_group() -> None:
    barrier_safe(timeout_s=1, monitored=True)
    with main_process_first() as is_main:
        assert is_main


def test_helpers_are_no_ops_in_a_world_of_one() -> None:
    assert spawn(sync_workers.single_rank_helpers, 1) == [(1, True)]


def test_the_incident_rank0_saves_while_the_others_time_out(tmp_path: Path) -> None:
    with pytest.raises(WorkerError) as info:
        spawn(train_and_save_worker, 3, str(tmp_path), "none", 2.0, timeout_s=40, pg_timeout_s=1)
    assert info.value.rank in (1, 2) and "Timed out" in str(info.value)
    # The waiting ranks died inside their next train step, while rank 0 was still saving.
    save = _spans(tmp_path, 0, "save")[0]
    for rank in (1, 2):
        failed = [s for s in _spans(tmp_path, rank, "train step") if s["error"]]
        assert failed and failed[0]["end"] <= save["end"]


def test_a_plain_barrier_moves_the_wait_but_keeps_the_timeout(tmp_path: Path) -> None:
    with pytest.raises(WorkerError) as info:
        spawn(train_and_save_worker, 3, str(tmp_path), "plain", 2.0, timeout_s=40, pg_timeout_s=1)
    assert "Timed out" in str(info.value)
    assert any(s["error"] for r in (1, 2) for s in _spans(tmp_path, r, "barrier"))


def test_barrier_safe_with_a_save_budget_fixes_it(tmp_path: Path) -> None:
    spent = spawn(
        train_and_save_worker, 3, str(tmp_path), "safe", 2.0, 3, 30.0, timeout_s=40, pg_timeout_s=1
    )
    assert [s["save"] > 0 for s in spent] == [True, False, False]
    save_end = _spans(tmp_path, 0, "save")[0]["end"]
    for rank in (1, 2):
        (barrier,) = _spans(tmp_path, rank, "barrier")
        assert barrier["end"] >= save_end and not barrier["error"]
        assert len(_spans(tmp_path, rank, "train step")) == 3  # training went on


def test_dist_barrier_with_its_own_timeout_fixes_it_too(tmp_path: Path) -> None:
    spawn(
        train_and_save_worker,
        3,
        str(tmp_path),
        "timeout",
        2.0,
        3,
        30.0,
        timeout_s=40,
        pg_timeout_s=1,
    )
    save_end = _spans(tmp_path, 0, "save")[0]["end"]
    for rank in (1, 2):
        (barrier,) = _spans(tmp_path, rank, "barrier")
        assert barrier["end"] >= save_end and not barrier["error"]


def test_barrier_timeout_overrides_the_group_timeout_on_gloo() -> None:
    # The late rank is 2 s late; the group's timeout is 1 s; the barrier's own is 10 s.
    passed = spawn(late_barrier_worker, 2, 1, 2.0, 10.0, timeout_s=40, pg_timeout_s=1)
    assert [outcome for outcome, _ in passed] == ["passed", "passed"]
    assert passed[0][1] >= 1.5  # rank 0 really waited past the group's timeout
    failed = spawn(late_barrier_worker, 2, 1, 2.0, None, timeout_s=40, pg_timeout_s=1)
    assert failed[0][0].startswith("Timed out waiting 1000ms")


def test_a_barrier_only_rank0_calls_is_named_by_monitored_barrier(tmp_path: Path) -> None:
    with pytest.raises(WorkerError) as info:
        spawn(
            train_and_save_worker,
            3,
            str(tmp_path),
            "misplaced",
            0.3,
            3,
            1.0,
            timeout_s=40,
            pg_timeout_s=3,
        )
    assert info.value.rank == 0
    assert "Ranks 1, 2 failed to pass monitoredBarrier" in str(info.value)


def test_monitored_barrier_names_the_late_rank() -> None:
    with pytest.raises(WorkerError) as info:
        spawn(straggler_worker, 3, 2, 3.0, 1.0, timeout_s=30, pg_timeout_s=5)
    assert info.value.rank == 0 and "Ranks 2 failed to pass monitoredBarrier" in str(info.value)


def test_monitored_barrier_passes_when_everyone_is_on_time() -> None:
    assert spawn(straggler_worker, 3, 2, 0.0, 5.0, timeout_s=30) == [0, 1, 2]


def test_without_ordering_other_ranks_read_before_rank0_wrote(tmp_path: Path) -> None:
    with pytest.raises(WorkerError) as info:
        spawn(main_process_first_worker, 3, str(tmp_path), False, timeout_s=30)
    assert info.value.rank in (1, 2) and isinstance(info.value.__cause__, FileNotFoundError)


def test_main_process_first_lets_everyone_read_what_rank0_wrote(tmp_path: Path) -> None:
    assert (
        spawn(main_process_first_worker, 3, str(tmp_path), True, timeout_s=30) == ["vocab v1"] * 3
    )


def test_a_failure_on_rank0_reaches_every_rank_instead_of_a_hang() -> None:
    # timeout_s is far below the group's 30 s: a hang would end as WorkerTimeout.
    try:
        seen = spawn(sync_workers.what_each_rank_sees_when_rank0_fails, 3, timeout_s=20)
    except WorkerTimeout:  # pragma: no cover - the failure this test exists to catch
        pytest.fail("the other ranks hung instead of hearing about rank 0's failure")
    assert seen == ["ValueError", "MainProcessFailed", "MainProcessFailed"]


def test_the_launcher_reports_rank0_as_the_cause(tmp_path: Path) -> None:
    with pytest.raises(WorkerError) as info:
        spawn(main_process_first_worker, 3, str(tmp_path), True, True, timeout_s=30)
    assert info.value.rank == 0 and "No space left" in str(info.value)


def test_barrier_wait_covers_the_save(tmp_path: Path) -> None:
    (r0, r1, r2) = spawn(barrier_cost_worker, 3, str(tmp_path), [1, 4], 1, timeout_s=60)
    for (save, total0), (zero1, wait1), (zero2, wait2) in zip(r0, r1, r2, strict=True):
        assert save > 0 and zero1 == zero2 == 0
        assert total0 >= save and min(wait1, wait2) > 0


def test_short_error_is_reproducible() -> None:
    err = RuntimeError(
        "[/src/gloo/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation"
    )
    assert short_error(err) == "Timed out waiting 2000ms for send/recv operation"
    assert short_error(None) == ""
    peer = RuntimeError("[/src/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:41234. Hi")
    assert short_error(peer) == "Connection closed by peer. Hi"


def test_timeline_is_readable_and_plottable(tmp_path: Path) -> None:
    tl = Timeline(tmp_path, rank=1)
    with tl.span("save"):
        pass
    with pytest.raises(KeyError), tl.span("barrier"):
        raise KeyError("x")
    spans = read_timeline(tmp_path)
    assert [(s["phase"], s["error"]) for s in spans] == [("save", ""), ("barrier", "KeyError")]
    # A span whose rank died mid-way (no end line) is drawn up to the last record, "killed".
    tl._file.write(json.dumps({"rank": 1, "phase": "save", "start": 10**9}) + "\n")
    assert read_timeline(tmp_path)[-1]["error"] == "killed"
    assert spans[0]["start"] == 0.0
    ax = plot_timeline(spans, "test")
    assert ax.get_title() == "test" and len(ax.patches) == 2


@pytest.mark.timeout(120)
def test_a_ddp_forward_inside_main_process_first_hangs_the_bare_model_does_not() -> None:
    """The rule main_process_first's docstring states: rank 0's evaluation inside the block
    through the DDP-wrapped model (buffers, after a training step) waits in a broadcast no
    other rank joins, until the group timeout; through the unwrapped model it runs alone."""
    ok = spawn(sync_workers.evaluate_inside_main_process_first, 2, True, timeout_s=60)
    assert ok == ["evaluated", "evaluated"]
    with pytest.raises(WorkerError) as caught:
        worker = sync_workers.evaluate_inside_main_process_first
        spawn(worker, 2, False, timeout_s=60, pg_timeout_s=3)
    assert caught.value.rank == 0, caught.value
