"""refimpl.demos.ddp_details: chapter 2's details checked against torch's DDP. Buffers at
construction and the deprecated flag, MiniDDP's buffer drift without a re-sync, where
``no_sync`` is decided, accumulation against the global batch, DDP's own unused-parameter
error under each debug level, and ``Join`` for uneven inputs."""

from __future__ import annotations

import pytest
from workers import ddp as ddp_workers

from refimpl.demos.ddp_details import (
    accumulation_matches_global_batch,
    buffer_drift,
    buffers_at_construction,
    ddp_unused_parameter,
    join_uneven_inputs,
    no_sync_placement,
    trim_ddp_error,
)
from refimpl.launch import WorkerError, spawn


def test_buffers_at_construction_and_the_deprecated_flag() -> None:
    r = spawn(buffers_at_construction, 2, timeout_s=60)[0]
    assert r["DDP(model)"] == "buffers equal after construction: True"
    assert r["DDP(model, broadcast_buffers=False)"].startswith(
        "buffers equal after construction: False; FutureWarning: `broadcast_buffers` is deprecated"
    )
    assert r["DDP(model, forward_sync_buffers=False)"] == "buffers equal after construction: True"


@pytest.mark.slow
def test_forward_sync_buffers_follows_ddp_and_plain_miniddp_drifts() -> None:
    for r in spawn(ddp_workers.buffer_parity, 2, timeout_s=60):
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


@pytest.mark.slow
def test_join_lets_a_rank_with_fewer_batches_finish() -> None:
    stuck = spawn(join_uneven_inputs, 2, False, 3.0, timeout_s=60, pg_timeout_s=2)
    assert stuck[0].startswith("stopped after 2 batches") and "Timed out" in stuck[0]
    assert spawn(join_uneven_inputs, 2, True, timeout_s=60, pg_timeout_s=3) == [
        "finished its 3 batches",
        "finished its 2 batches",
    ]


def test_sum_order_depends_on_the_layout_from_three_ranks_on() -> None:
    from refimpl.demos.ddp_details import sum_order_by_layout

    two = spawn(sum_order_by_layout, 2, timeout_s=60)[0]
    assert set(two.values()) == {0}  # a + b == b + a: two ranks never differ
    three = spawn(sum_order_by_layout, 3, timeout_s=60)[0]
    assert three["in two buckets"] > 0 and max(three.values()) <= 1000, three


def test_static_graph_is_what_reentrant_checkpointing_twice_needs() -> None:
    from refimpl.demos.ddp_details import checkpoint_twice

    good = {"error": "", "true average": True, "ranks agree": True}
    for use_reentrant, static_graph in ((False, False), (False, True), (True, True)):
        assert spawn(checkpoint_twice, 2, use_reentrant, static_graph) == [good] * 2
    # reentrant, no static_graph: no error, and each rank keeps a different gradient
    quiet = spawn(checkpoint_twice, 2, True, False)
    assert [r["error"] for r in quiet] == ["", ""]
    assert not any(r["true average"] or r["ranks agree"] for r in quiet), quiet
