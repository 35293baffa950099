"""refimpl.demos.desync: what PyTorch's own tools show of chapter 7's hang, on gloo: the
flight recorder's dumps, read by torchfrtrace, name the first call whose kind differs; under
DETAIL every collective first passes a monitored barrier that rank 0 runs."""

from __future__ import annotations

import pickle
from pathlib import Path

from refimpl.demos import desync
from refimpl.demos import multitask as mt
from refimpl.launch import spawn


def test_torchfrtrace_on_the_hangs_dumps_names_the_first_mismatched_kind(tmp_path: Path) -> None:
    res = spawn(
        mt.multitask_loop, 2, 8, kwargs={"flight_recorder": str(tmp_path)}, pg_timeout_s=3.0
    )
    fewer = min(len(r["calls"]) for r in res)
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert dumps == ["rank_0", "rank_1"]
    raw = pickle.loads((tmp_path / "rank_0").read_bytes())
    assert "" not in raw["pg_config"]  # the unnamed group was given its entries' name
    kinds = [e["profiling_name"] for e in raw["entries"]]
    assert kinds == ["gloo:all_reduce"] * fewer + ["gloo:barrier"]
    report = desync.read_flight_recorder(str(tmp_path))
    # every all-reduce before paired a metric with another of the same shape: no error there;
    # the first error is the extra all-reduce meeting the barrier (sequence numbers from 1)
    assert f"Collective sequence number: {fewer + 1} has errors" in report, report
    assert report.count("collective: gloo:barrier") == 1
    assert any(
        "COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'barrier' does not match found "
        "collective type: 'all_reduce'" in line
        for line in report
    ), report


def test_detail_puts_a_monitored_barrier_run_by_rank_0_before_each_collective() -> None:
    with mt.environment(TORCH_DISTRIBUTED_DEBUG="DETAIL"):
        out = spawn(desync.late_rank_under_detail, 3, 1.2, pg_timeout_s=0.5, timeout_s=60)
    # rank 0 collects every rank and names the one missing; rank 1 only hears nothing back
    # from rank 0; the late rank's all_reduce fails inside the wrapper's barrier
    assert out[0].startswith("rank 0: [Rank 0]: Ranks 2 failed to pass monitoredBarrier"), out
    assert out[1].startswith(
        "rank 1: Rank 1 successfully reached monitoredBarrier, but received errors while "
        "waiting for send/recv from rank 0"
    ), out
    assert out[2].startswith(
        "rank 2: ProcessGroupWrapper: Monitored Barrier encountered error running collective: "
        "CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE"
    ), out


def test_under_detail_each_collective_is_preceded_by_two_all_gathers() -> None:
    with mt.environment(TORCH_DISTRIBUTED_DEBUG="DETAIL"):
        entries = spawn(desync.detail_recorded_calls, 2, 2)
    # the wrapper's verify(): the fingerprint's length, then the fingerprint (7 int64 for one
    # 1-D tensor), then the all-reduce itself; the monitored barrier is send/recv, unrecorded
    per_call = ["gloo:all_gather [[1]]", "gloo:all_gather [[7]]", "gloo:all_reduce [[2]]"]
    assert entries == [per_call * 2] * 2
