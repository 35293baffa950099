"""assign_buckets is PyTorch's partition rule: the same buckets as PyTorch's own assignment
function (several models, caps, first-bucket sizes and both parameter orders) and as a live
DistributedDataParallel after it rebuilds its buckets from the gradient-ready order."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from refimpl.buckets import MB, assign_buckets, bucket_bytes
from refimpl.demos.ddp import make_mlp, rebuild_follows_rank0, torch_ddp_buckets
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
