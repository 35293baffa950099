"""refimpl.demos.multitask: chapter 7's failure modes happen, end within their timeouts, and
PyTorch's DETAIL mode catches the hang but not the same-shape twin."""

from __future__ import annotations

import time

import matplotlib
import pytest
import torch

from refimpl.demos import multitask as mt
from refimpl.launch import spawn

matplotlib.use("Agg")
PG = 3.0


def test_per_rank_choice_hangs_and_the_timeout_ends_it() -> None:
    start = time.monotonic()
    res = spawn(mt.multitask_loop, 2, 8, pg_timeout_s=PG, timeout_s=40)
    assert time.monotonic() - start < 30  # ended by the 3 s group timeout, not the launcher
    assert len(res[0]["calls"]) != len(res[1]["calls"])  # one rank made an extra all-reduce
    # Every rank ends in an error, and at least one by its group timeout. The other may time
    # out too, or, when the first one's exit tears the connection down before its own timer
    # fires (seen under a loaded CI machine), report the peer closing it.
    errors = [r["error"] or "" for r in res]
    assert any("Timed out" in e for e in errors), errors
    peer_gone = ("Timed out", "Connection closed by peer", "Connection reset by peer")
    assert all(any(p in e for p in peer_gone) for e in errors), errors
    names = [[c["name"] for c in r["calls"]] for r in res]
    assert names[0][0] != names[1][0]  # and the pairing was wrong from the first call
    truth = mt.true_means(res)
    got = {k: s / c for k, (s, c) in res[0]["synced"].items()}
    assert any(abs(got[k] - truth[k]) > 0.01 for k in got)


def test_quiet_twin_same_shapes_wrong_numbers_no_error() -> None:
    res = spawn(mt.multitask_loop, 2, 8, kwargs={"datasets": ("cls", "det")}, timeout_s=40)
    assert [r["error"] for r in res] == [None, None]
    truth = mt.true_means(res)
    got = {k: s / c for k, (s, c) in res[0]["synced"].items()}
    assert any(abs(got[k] - truth[k]) > 0.01 for k in got)


def test_detail_catches_the_hang_but_not_the_twin() -> None:
    with mt.environment(TORCH_DISTRIBUTED_DEBUG="DETAIL"):
        hang = spawn(mt.multitask_loop, 2, 8, pg_timeout_s=PG, timeout_s=40)
        twin = spawn(mt.multitask_loop, 2, 8, kwargs={"datasets": ("cls", "det")}, timeout_s=40)
    assert all("Detected mismatch between collectives" in r["error"] for r in hang)
    assert all(r["seconds"] < PG for r in hang)  # caught at the call, not by the timeout
    assert [r["error"] for r in twin] == [None, None]
    assert mt.os.environ.get("TORCH_DISTRIBUTED_DEBUG") is None  # restored after the block


def test_monitored_barrier_names_the_late_rank() -> None:
    res = spawn(mt.multitask_loop, 2, 8, kwargs={"barrier_at_end": "monitored"}, pg_timeout_s=PG)
    late = 1 if len(res[1]["calls"]) > len(res[0]["calls"]) else 0
    assert late == 1  # with seed 3, rank 1 makes the extra call; rank 0 runs the barrier
    assert f"Rank {late} failed to pass monitoredBarrier" in res[0]["error"]


def test_all_gather_object_reads_a_float_as_a_size() -> None:
    out = spawn(mt.gather_object_meets_all_gather, 2, pg_timeout_s=PG, timeout_s=40)
    bits = torch.tensor([1e30], dtype=torch.float64).view(torch.int64).item()
    assert f"you tried to allocate {bits} bytes" in out[0]


def test_the_fix_pairs_every_call_and_the_figure_shows_it() -> None:
    before = spawn(mt.multitask_loop, 2, 8, pg_timeout_s=PG, timeout_s=40)
    after = spawn(mt.multitask_loop, 2, 8, kwargs={"fixed": True}, timeout_s=40)
    assert [c["name"] for c in after[0]["calls"]] == [c["name"] for c in after[1]["calls"]]
    fig = mt.plot_call_sequences(before, after)
    edges = [p.get_edgecolor() for ax in fig.axes for p in ax.patches]
    assert (0.0, 0.0, 0.0, 1.0) in edges  # disagreements drawn in the "before" panel only
    assert all(p.get_edgecolor() != (0.0, 0.0, 0.0, 1.0) for p in fig.axes[1].patches)
    assert "! #0" in mt.call_table(before) and "! " not in mt.call_table(after)


def test_metric_values_are_deterministic_and_bounded() -> None:
    vals = [mt.metric_value(d, t, i) for d in mt.TASKS for t in mt.TASKS[d] for i in range(50)]
    assert all(0 <= v < 1 for v in vals) and len(set(vals)) > 100
    with pytest.raises(ValueError):
        mt.metric_value("cls", "iou", 0)  # cls has no iou task


def test_naive_draws_are_the_loops_draws_and_tasks_can_be_given() -> None:
    twin = spawn(mt.multitask_loop, 2, 8, kwargs={"datasets": ("cls", "det")}, timeout_s=40)
    for r in twin:
        per_step = {c["step"]: c["name"].split("/")[0] for c in r["calls"]}
        assert [per_step[s] for s in range(8)] == mt.naive_draws(r["rank"], 8, ("cls", "det"))
    tasks = {"cls": ("loss", "acc"), "det": ("loss", "map", "recall")}
    kwargs = {"datasets": ("cls", "det"), "tasks": tasks, "guard": True}
    guarded = spawn(mt.multitask_loop, 2, 8, kwargs=kwargs, timeout_s=40)
    # predicted without running: each rank's call names from its draws and the tasks
    expected = [
        [f"{d}/{t}" for d in mt.naive_draws(rank, 8, ("cls", "det")) for t in tasks[d]]
        for rank in (0, 1)
    ]
    first = next(i for i, (a, b) in enumerate(zip(*expected, strict=False)) if a != b)
    for r in guarded:
        assert r["error"].startswith(f"CollectiveMismatch: ranks disagree on collective #{first}")
        assert [c["name"] for c in r["calls"]] == expected[r["rank"]][: first + 1]
    assert mt.metric_value("det", "recall", 3, tasks) != mt.metric_value("det", "map", 3, tasks)


def test_skipping_a_guarded_call_is_a_mismatch_unless_it_is_the_last() -> None:
    middle = spawn(mt.skip_a_guarded_call, 2, "val/acc", timeout_s=40)
    assert all("ranks disagree on collective #1" in e for e in middle), middle
    assert "rank 0: call #1 all_reduce (SUM) 'val/acc' float64[2]" in middle[1]
    assert "rank 1: call #1 all_reduce (SUM) 'val/f1' float64[2]" in middle[1]
    last = spawn(mt.skip_a_guarded_call, 2, "val/f1", timeout_s=40)
    assert last[1] == "no error"  # rank 1 made both its calls and left
    assert "all_reduce 'val/f1' (call #2)" in last[0].splitlines()[0], last[0]
    assert "rank 1 last passed call #1 all_reduce (SUM) 'val/acc'" in last[0], last[0]


def test_wrap_folds_every_line() -> None:
    text = "short\n" + "word " * 40
    assert all(len(line) <= 96 for line in mt.wrap(text).splitlines())
    assert mt.wrap(text).splitlines()[0] == "short"
