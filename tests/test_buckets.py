"""assign_buckets is PyTorch's partition rule: the same buckets as PyTorch's own assignment
function (several models, caps, first-bucket sizes and both parameter orders) and as a live
DistributedDataParallel after it rebuilds its buckets from the gradient-ready order. And
chapter 3's workers (refimpl.demos.buckets): overlap timelines, DDP's own statistics, the
fp16 hook's error and overflow, where DDP puts its small first bucket, and a hook that
forgets to average."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from refimpl.buckets import MB, assign_buckets, bucket_bytes
from refimpl.demos.buckets import (
    ddp_hook_trace,
    ddp_small_bucket,
    ddp_statistics,
    fp16_hook_error,
    fp16_overflow,
    grad_scaler_with_fp16_hook,
    timeline,
    undivided_hook,
)
from refimpl.demos.ddp import make_mlp, torch_ddp_buckets
from refimpl.demos.ddp_details import rebuild_follows_rank0
from refimpl.launch import spawn


def _models() -> dict[str, list[torch.Tensor]]:
    torch.manual_seed(0)
    conv = nn.Sequential(
        nn.Conv2d(3, 32, 3), nn.BatchNorm2d(32), nn.Conv2d(32, 64, 3), nn.Linear(64, 10)
    )
    mixed = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64).double(), nn.Linear(64, 64))
    return {
        "mlp": list(make_mlp((256, 512, 512, 512, 8)).parameters()),
        "conv": list(conv.parameters()),
        "transformer": list(nn.TransformerEncoderLayer(128, 4, 512).parameters()),
        "mixed-dtype": list(mixed.parameters()),
    }


CAPS = [(0.001, None), (0.01, 0.001), (0.25, None), (1.0, None), (25.0, 1.0), (5.0, 0.5)]


@pytest.mark.parametrize("name", list(_models()))
@pytest.mark.parametrize(("cap", "first"), CAPS)
def test_assign_buckets_equals_pytorch_in_ready_order(name: str, cap: float, first: float | None):
    params = _models()[name]
    order = list(reversed(range(len(params))))
    limits = [int((cap if first is None else first) * MB), int(cap * MB)]
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, [False] * len(params), order
    )
    mine = assign_buckets(params, cap, first)
    if name == "mixed-dtype":
        # PyTorch appends still-open buckets of several dtypes in hash-map order.
        assert sorted(mine) == sorted(theirs)
    else:
        assert mine == theirs
    assert sorted(i for b in mine for i in b) == list(range(len(params)))


@pytest.mark.parametrize("name", list(_models()))
@pytest.mark.parametrize(("cap", "first"), CAPS)
def test_assign_buckets_equals_pytorch_in_definition_order(name, cap, first):
    """The construction-time call: parameters in definition order, buckets sorted by index."""
    params = _models()[name]
    limits = [int((cap if first is None else first) * MB), int(cap * MB)]
    theirs, _ = dist._compute_bucket_assignment_by_size(params, limits)
    mine = assign_buckets(params, cap, first, order=range(len(params)))
    assert sorted(mine, key=min) == theirs


def test_each_bucket_closes_on_the_parameter_that_reaches_its_cap() -> None:
    params = _models()["transformer"]
    buckets = assign_buckets(params, 0.5, 0.1)
    caps = [0.1 * MB] + [0.5 * MB] * len(buckets)
    for bucket, cap in zip(buckets[:-1], caps, strict=False):  # the last one may stay short
        assert bucket_bytes(params, [bucket])[0] >= cap > bucket_bytes(params, [bucket[:-1]])[0]
    assert bucket_bytes(params, buckets[:1])[0] < 0.5 * MB  # a smaller first bucket


def test_assign_buckets_refuses_bad_arguments() -> None:
    params = _models()["mlp"]
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(params, 0)
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets(params, 1.0, order=[0, 0, 1])


@pytest.mark.parametrize("cap", [None, 0.3])
def test_assign_buckets_equals_a_live_ddp_after_its_rebuild(cap: float | None) -> None:
    seen = spawn(torch_ddp_buckets, 2, cap, timeout_s=60)[0]
    n = len(seen["ready order"])
    # PyTorch 2.13 starts with one bucket (find_unused_parameters=False) ...
    assert seen["construction"] == [sorted(range(n))] == seen["after step 1"]
    # ... and rebuilds by the gradient-ready order it observed, with our rule.
    assert seen["after step 2"] == seen["assign_buckets"]
    assert len(seen["after step 2"]) >= 2


def test_ddp_rebuilds_from_rank_0s_order_on_every_rank() -> None:
    """Rank 1's gradients become ready in another order than rank 0's, yet after the rebuild
    both ranks hold the buckets of rank 0's order. static_graph=True rebuilds too (one step
    later), with or without find_unused_parameters; find_unused_parameters alone never does."""
    rank0, rank1 = spawn(rebuild_follows_rank0, 2, timeout_s=60)
    plain = rank1["DDP(model)"]
    assert plain["ready order"] != rank0["DDP(model)"]["ready order"]
    assert plain["assign_buckets(own order)"] != plain["assign_buckets(rank 0's order)"]
    for r in (rank0, rank1):
        expected = r["DDP(model)"]["assign_buckets(rank 0's order)"]
        assert r["DDP(model)"]["buckets"][2:] == [expected, expected]  # after steps 2 and 3
        for label in ("static_graph=True", "static_graph=True, find_unused_parameters=True"):
            construction, *after = r[label]["buckets"]
            assert after == [construction, construction, expected], label
        unused = r["find_unused_parameters=True"]["buckets"]
        assert unused == [unused[0]] * 4 and len(unused[0]) == 2


def test_traced_timeline_has_a_completion_for_every_launch(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from refimpl.buckets import draw_timeline

    for impl in ("mini", "naive"):
        trace = spawn(timeline, 2, impl, 0.5, (64, 64, 64, 8), 8, timeout_s=60)[0]
        kinds = [k for _, k, _ in trace["events"]]
        assert kinds.count("launch") == kinds.count("done") == len(trace["buckets"]), impl
        assert kinds.count("grad") == len(trace["names"])
        figure = draw_timeline(trace).figure
        figure.savefig(tmp_path / f"{impl}.png")
        plt.close(figure)  # later tests in this process count the open figures


def test_fp16_hook_halves_bytes_with_bounded_error() -> None:
    r = spawn(fp16_hook_error, 2, 1000, timeout_s=60)[0]
    assert r["fp16_bytes"] * 2 == r["fp32_bytes"]
    assert 0 < r["max_rel_error"] < 1e-3


def test_ddp_launches_one_bucket_at_step_1_and_overlaps_after_the_rebuild() -> None:
    steps = spawn(ddp_hook_trace, 2, (512,) * 3, 3, timeout_s=60)[0]["steps"]
    first = [(k, i) for _, k, i in steps[0]["events"]]
    assert steps[0]["buckets"] == [[0, 1, 2, 3]]  # step 1: one bucket, launched at the end
    assert first.index(("launch", 0)) > first.index(("grad", 0))
    third = [(k, i) for _, k, i in steps[2]["events"]]
    assert steps[2]["buckets"] == [[3, 2], [1, 0]]  # rebuilt: 1 MB first bucket
    assert third.index(("launch", 0)) < third.index(("grad", 0))  # overlap
    assert third.count(("done", 0)) == third.count(("done", 1)) == 1


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


@pytest.mark.slow
def test_grad_scaler_skips_steps_when_the_fp16_hook_overflows() -> None:
    plain = spawn(grad_scaler_with_fp16_hook, 2, False, 4, timeout_s=60)[0]
    hooked = spawn(grad_scaler_with_fp16_hook, 2, True, 4, timeout_s=60)[0]
    assert all(s.startswith("step") for s in plain)
    assert hooked[0] == "SKIP (scale 32768)" and hooked[-1].startswith("step")


def test_the_small_first_bucket_ends_up_at_either_end() -> None:
    """Default DDP (25 MB, 1 MB first) on the benchmark's model: rebuilt from the ready order,
    the 1 MB-capped bucket is the last layer (reduced first); with find_unused_parameters
    there is no rebuild and it is the first layer's weight (reduced last). A parameter is
    never split, so the capped bucket holds one 2.25 MB weight either way."""
    r = spawn(ddp_small_bucket, 2, timeout_s=120)[0]
    assert r["find_unused_parameters=False"] == (
        "[38.bias..38.weight: 2.3], [36.bias..14.weight: 27.0], [12.bias..0.weight: 15.8]"
    )
    unused = r["find_unused_parameters=True"].split(", ")
    assert unused[-1] == "[0.weight..0.weight: 2.2]" and len(unused) == 3, unused


def test_a_hook_that_does_not_divide_doubles_every_gradient() -> None:
    for r in spawn(undivided_hook, 2, timeout_s=60):
        assert r["sum-only == world_size * no hook"] is True
        assert float(r["max |grad|, sum-only hook"]) > float(r["max |grad|, no hook"]) > 0


def test_a_smaller_initial_scale_avoids_the_skipped_steps() -> None:
    assert (
        spawn(grad_scaler_with_fp16_hook, 2, True, 3, 1024.0, timeout_s=60)[0]
        == ["step (scale 1024)"] * 3
    )
