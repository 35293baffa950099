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

import _ddp_workers
import pytest

from refimpl.ddp import MiniDDP
from refimpl.demos.ddp import (
    accumulation_matches_global_batch,
    buffer_drift,
    buffers_at_construction,
    ddp_hook_trace,
    ddp_statistics,
    ddp_unused_parameter,
    fp16_hook_error,
    fp16_overflow,
    grad_scaler_with_fp16_hook,
    grad_storage,
    hook_and_launch_order,
    join_uneven_inputs,
    make_mlp,
    no_sync_placement,
    no_sync_step,
    parity_with_torch_ddp,
    timeline,
    trim_ddp_error,
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
    for grads in spawn(_ddp_workers.unused_parity, 2, skipper, timeout_s=60):
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
    assert spawn(_ddp_workers.naive_matches_mini, 2, timeout_s=60) == [0.0, 0.0]
    assert spawn(_ddp_workers.buffers_broadcast, 2, timeout_s=60) == [True, True]


def test_first_bucket_launches_while_backward_still_runs() -> None:
    order = spawn(hook_and_launch_order, 2, timeout_s=60)[0]
    assert order.index("launch bucket 0") < order.index("grad 0.weight")
    assert order[-1] == "launch bucket 1"


def test_miniddp_without_process_group_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        MiniDDP(make_mlp())


def test_traced_timeline_has_a_completion_for_every_launch(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from refimpl.buckets import draw_timeline

    for impl in ("mini", "naive"):
        trace = spawn(timeline, 2, impl, 0.5, (64, 64, 64, 8), 8, timeout_s=60)[0]
        kinds = [k for _, k, _ in trace["events"]]
        assert kinds.count("launch") == kinds.count("done") == len(trace["buckets"]), impl
        assert kinds.count("grad") == len(trace["names"])
        draw_timeline(trace).figure.savefig(tmp_path / f"{impl}.png")


def test_fp16_hook_halves_bytes_with_bounded_error() -> None:
    r = spawn(fp16_hook_error, 2, 1000, timeout_s=60)[0]
    assert r["fp16_bytes"] * 2 == r["fp32_bytes"]
    assert 0 < r["max_rel_error"] < 1e-3


def test_benchmark_writes_json_and_png(tmp_path: Path) -> None:
    from refimpl.bench.ddp import main

    argv = ["--out", str(tmp_path), "--repeats", "2", "--steps", "1", "--width", "32"]
    assert main([*argv, "--depth", "2", "--caps", "1"]) == 0
    data = json.loads((tmp_path / "bench_ddp.json").read_text())
    assert set(data["results"]["1.0"]) == {"naive", "mini", "ddp_view", "ddp_default"}
    ratios = data["ratios"]["1.0"]
    assert set(ratios) == {"mini/ddp_view", "naive/ddp_view", "ddp_default/ddp_view",
                           "mini/ddp_default"}  # fmt: skip
    for r in ratios.values():
        assert r["q1"] <= r["median"] <= r["q3"] and r["ratio_of_medians"] > 0
    assert (tmp_path / "bench_ddp.png").stat().st_size > 0


# --- what PyTorch's DDP does, and where MiniDDP differs (chapter 2) ------------------------


def test_grad_is_a_bucket_view_in_miniddp_and_ddp_view_not_in_ddp_default() -> None:
    r = spawn(grad_storage, 2, timeout_s=60)[0]
    assert r["DDP(model)"] == "6 gradients in 6 storage(s)"  # copied back: one each
    assert r["DDP(model, gradient_as_bucket_view=True)"] == "6 gradients in 2 storage(s)"
    assert r["MiniDDP(model)"] == "6 gradients in 2 storage(s)"


def test_buffers_at_construction_and_the_deprecated_flag() -> None:
    r = spawn(buffers_at_construction, 2, timeout_s=60)[0]
    assert r["DDP(model)"] == "buffers equal after construction: True"
    assert r["DDP(model, broadcast_buffers=False)"].startswith(
        "buffers equal after construction: False; FutureWarning: `broadcast_buffers` is deprecated"
    )
    assert r["DDP(model, forward_sync_buffers=False)"] == "buffers equal after construction: True"


def test_forward_sync_buffers_follows_ddp_and_plain_miniddp_drifts() -> None:
    for r in spawn(_ddp_workers.buffer_parity, 2, timeout_s=60):
        assert r == {"sync equals DDP": True, "plain MiniDDP differs across ranks": True}
    r = spawn(buffer_drift, 2, 10, timeout_s=60)[0]
    assert r["MiniDDP(model, forward_sync_buffers=True)"] == r["DDP(model)"]
    assert r["MiniDDP(model)"] != r["DDP(model)"]
    assert r["nn.SyncBatchNorm on CPU"].startswith("ValueError: SyncBatchNorm expected input")


def test_no_sync_is_decided_at_forward_in_ddp_and_at_backward_in_miniddp() -> None:
    for r in spawn(no_sync_placement, 2, timeout_s=60):
        assert r["forward and backward inside"] == {"DDP": False, "MiniDDP": False}
        assert r["forward outside, backward inside"] == {"DDP": True, "MiniDDP": False}
        assert r["forward inside, backward outside"] == {"DDP": False, "MiniDDP": True}


def test_accumulation_over_ranks_equals_the_global_batch() -> None:
    assert max(spawn(accumulation_matches_global_batch, 2, timeout_s=60)) < 1e-6


def test_ddp_unused_parameter_error_names_parameters_only_under_debug() -> None:
    with pytest.raises(WorkerError) as info:
        spawn(ddp_unused_parameter, 2, timeout_s=60, pg_timeout_s=3)
    assert info.value.rank == 1
    msg = trim_ddp_error(str(info.value.__cause__))
    assert msg.startswith("Expected to have finished reduction in the prior iteration")
    assert "Parameter indices which did not receive grad for rank 1: 2 3" in msg
    assert "branch" not in msg
    waiting, failing = spawn(ddp_unused_parameter, 2, "INFO", 3.0, timeout_s=60, pg_timeout_s=2)
    assert "Parameters which did not receive grad for rank 1: branch.bias, branch.weight" in failing
    assert waiting.startswith("step 1:") and "Timed out" in waiting and "branch" not in waiting


def test_ddp_launches_one_bucket_at_step_1_and_overlaps_after_the_rebuild() -> None:
    steps = spawn(ddp_hook_trace, 2, (512,) * 3, 3, timeout_s=60)[0]["steps"]
    first = [(k, i) for _, k, i in steps[0]["events"]]
    assert steps[0]["buckets"] == [[0, 1, 2, 3]]  # step 1: one bucket, launched at the end
    assert first.index(("launch", 0)) > first.index(("grad", 0))
    third = [(k, i) for _, k, i in steps[2]["events"]]
    assert steps[2]["buckets"] == [[3, 2], [1, 0]]  # rebuilt: 1 MB first bucket
    assert third.index(("launch", 0)) < third.index(("grad", 0))  # overlap
    assert third.count(("done", 0)) == third.count(("done", 1)) == 1


def test_join_lets_a_rank_with_fewer_batches_finish() -> None:
    stuck = spawn(join_uneven_inputs, 2, False, 3.0, timeout_s=60, pg_timeout_s=2)
    assert stuck[0].startswith("stopped after 2 batches") and "Timed out" in stuck[0]
    assert spawn(join_uneven_inputs, 2, True, timeout_s=60, pg_timeout_s=3) == [
        "finished its 3 batches",
        "finished its 2 batches",
    ]


# --- DDP statistics, fp16 hooks (chapter 3) ------------------------------------------------


def test_ddp_statistics_are_sampled_and_positive() -> None:
    r = spawn(ddp_statistics, 2, (64,) * 3, 12, timeout_s=60)[0]
    assert r["sampled iteration"] == 10  # iterations 1-10, then every 100th
    assert r["avg_backward_comm_time"] > 0 and r["avg_backward_compute_time"] > 0
    assert r["gradient_as_bucket_view"] == 0


def test_fp16_hook_casts_before_dividing_and_overflows() -> None:
    for r in spawn(fp16_overflow, 2, timeout_s=60):
        assert r["DDP, no hook (float32)"] == "60000"
        assert r["DDP + default_hooks.fp16_compress_hook"] == "inf"
        assert r["MiniDDP + fp16_compress_hook"] == "inf"
        assert r["DDP + a hook that divides, then casts"] == "60000"
        assert r["bf16_compress_hook on gloo"].startswith("TypeError: BF16 all reduce")


def test_grad_scaler_skips_steps_when_the_fp16_hook_overflows() -> None:
    plain = spawn(grad_scaler_with_fp16_hook, 2, False, 4, timeout_s=60)[0]
    hooked = spawn(grad_scaler_with_fp16_hook, 2, True, 4, timeout_s=60)[0]
    assert all(s.startswith("step") for s in plain)
    assert hooked[0] == "SKIP (scale 32768)" and hooked[-1].startswith("step")
