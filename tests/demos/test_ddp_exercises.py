"""refimpl.demos.ddp_exercises: chapter 2's exercises, DDP's rules broken on purpose."""

from __future__ import annotations

from refimpl.demos.ddp_exercises import no_sync_on_one_rank, train_without_broadcast
from refimpl.launch import spawn


def test_without_the_broadcast_the_replicas_stay_as_far_apart_as_their_seeds() -> None:
    apart = spawn(train_without_broadcast, 2, 3, timeout_s=60)
    assert apart[0] == [0.0] * 4  # rank 0 against itself
    assert apart[1][0] > 0.1 and len(set(apart[1])) == 1, apart[1]  # the gap never shrinks
    assert spawn(train_without_broadcast, 2, 3, True, timeout_s=60) == [[0.0] * 4] * 2


def test_no_sync_on_one_rank_pairs_the_wrong_all_reduces_then_leaves_one_waiting() -> None:
    r0, r1 = spawn(no_sync_on_one_rank, 2, timeout_s=60, pg_timeout_s=2)
    assert r0["ended"] == "finished" and len(r0["params after each step"]) == 2
    # Rank 1's first micro-step paired with rank 0's second: no error, different replicas.
    assert r1["params after each step"][0] != r0["params after each step"][0]
    assert r1["ended"].startswith("rank 1: the all-reduce of bucket 0"), r1["ended"]
    assert r0["all-reduces launched"] == r1["all-reduces launched"] == 4
