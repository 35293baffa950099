"""MiniDDP is proven against the real thing: the same gradients and parameters as
DistributedDataParallel after several SGD steps, and the same bucket partition as PyTorch's
own assignment function and a live DDP's rebuilt buckets.

Tolerance: with 2 ranks the comparison is exact (0.0). Both implementations divide each
gradient by the world size before summing (a power of two, so the division is exact) and a
sum of two floats does not depend on order. With 3 ranks 1/3 is inexact and the ranks' sums
can associate differently, so the tolerance is 1e-6 absolute: float32 rounding on gradients
of order 1, three orders of magnitude below any real disagreement (a missing micro-step or a
gradient not averaged changes them by ~1e-2 or more).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from workers import ddp as ddp_workers

from refimpl.ddp import MiniDDP
from refimpl.demos.ddp import (
    grad_storage,
    hook_and_launch_order,
    make_mlp,
    no_sync_step,
    parity_with_torch_ddp,
    unused_parameter_step,
)
from refimpl.launch import WorkerError, spawn

TOL = 1e-6


@pytest.mark.parametrize(
    ("world", "cap", "fp16"),
    [(2, 0.01, False), (2, 25.0, False), (2, 0.01, True), (3, 0.01, False)],
)
def test_gradients_and_parameters_equal_torch_ddp(world: int, cap: float, fp16: bool) -> None:
    """4 SGD+momentum steps of 2 micro-steps (one under no_sync), ranks starting unequal."""
    results = spawn(parity_with_torch_ddp, world, 4, 2, cap, fp16, timeout_s=120)
    for r in results:
        assert r["replicas_equal"]
        assert r["max_grad_diff"] <= TOL and r["max_param_diff"] <= TOL, r
        if world == 2:
            assert r["max_grad_diff"] == 0.0 and r["max_param_diff"] == 0.0, r
    assert results[0]["buckets"] == (1 if cap == 25.0 else 2)


@pytest.mark.parametrize("skipper", [1, None])
def test_find_unused_parameters_matches_torch_ddp(skipper: int | None) -> None:
    for grads in spawn(ddp_workers.unused_parity, 2, skipper, timeout_s=60):
        for name, diff in grads.items():
            if skipper is None and name.startswith("branch"):
                assert diff == (True, True), name  # nobody used it: grad stays None in both
            else:
                assert diff == 0.0, (name, diff)


def test_missing_gradient_without_find_unused_names_rank_and_fix() -> None:
    with pytest.raises(WorkerError) as info:
        spawn(unused_parameter_step, 2, False, timeout_s=30, pg_timeout_s=3)
    assert info.value.rank == 1
    assert "branch.weight" in str(info.value) and "find_unused_parameters=True" in str(info.value)


def test_the_waiting_rank_times_out_with_an_explanation() -> None:
    outcomes = spawn(unused_parameter_step, 2, False, 4.0, timeout_s=30, pg_timeout_s=2)
    assert outcomes[0].startswith("RuntimeError after waiting >= 2 s: rank 0: the all-reduce")
    assert outcomes[1].startswith("RuntimeError after waiting < 2 s: rank 1: backward finished")


def test_no_sync_launches_nothing_and_the_next_backward_syncs() -> None:
    for r in spawn(no_sync_step, 2, timeout_s=60):
        assert r["inside no_sync"] == {"all-reduces launched": 0, "grads equal across ranks": False}
        assert r["next backward"] == {"all-reduces launched": 2, "grads equal across ranks": True}


def test_naive_and_mini_agree_and_buffers_come_from_rank0() -> None:
    assert spawn(ddp_workers.naive_matches_mini, 2, timeout_s=60) == [0.0, 0.0]
    assert spawn(ddp_workers.buffers_broadcast, 2, timeout_s=60) == [True, True]


def test_first_bucket_launches_while_backward_still_runs() -> None:
    order = spawn(hook_and_launch_order, 2, timeout_s=60)[0]
    assert order.index("launch bucket 0") < order.index("grad 0.weight")
    assert order[-1] == "launch bucket 1"


def test_miniddp_without_process_group_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        MiniDDP(make_mlp())


@pytest.mark.slow
def test_benchmark_writes_json_and_png(tmp_path: Path) -> None:
    from refimpl.bench.ddp import main

    argv = ["--out", str(tmp_path), "--repeats", "2", "--steps", "1", "--width", "32"]
    assert main([*argv, "--depth", "2", "--caps", "1", "--profile-repeats", "2"]) == 0
    data = json.loads((tmp_path / "bench_ddp.json").read_text())
    impls = {"naive", "mini_late", "mini", "ddp_view", "ddp_default"}
    assert set(data["results"]["1.0"]) == impls
    for impl in impls:
        result = data["results"]["1.0"][impl]
        assert len(result["samples"]) == 2 and result["cpu"]["n"] == result["faults"]["n"] == 2
    ratios = data["ratios"]["1.0"]
    assert set(ratios) == {
        "mini/ddp_view",
        "mini_late/ddp_view",
        "naive/ddp_view",
        "ddp_default/ddp_view",
        "mini/ddp_default",
    }
    for r in ratios.values():
        assert r["q1"] <= r["median"] <= r["q3"] and r["ratio_of_medians"] > 0
    profile = data["profile"]["ms_per_step"]
    assert set(profile) == {"MiniDDP before", "MiniDDP", "DDP(view)", "DDP()"}
    for row in profile.values():
        assert row["step"] > 0 and row["training thread CPU"] > 0, row
    assert profile["MiniDDP"]["copies CPU"] > 0
    assert (tmp_path / "bench_ddp.png").stat().st_size > 0


# --- what PyTorch's DDP does, and where MiniDDP differs (chapter 2) ------------------------


def test_grad_is_a_bucket_view_in_miniddp_and_ddp_view_not_in_ddp_default() -> None:
    r = spawn(grad_storage, 2, timeout_s=60)[0]
    assert r["DDP(model)"] == "6 gradients in 6 storage(s)"  # copied back: one each
    assert r["DDP(model, gradient_as_bucket_view=True)"] == "6 gradients in 2 storage(s)"
    assert r["MiniDDP(model)"] == "6 gradients in 2 storage(s)"
