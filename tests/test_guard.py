"""refimpl.guard: every disagreement between ranks raises CollectiveMismatch on every rank,
naming each rank's call, including the same-shape case PyTorch's DETAIL mode lets through."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from workers import guard as guard_workers

from refimpl.demos import multitask as mt
from refimpl.guard import FINGERPRINT_LEN, CollectiveGuard
from refimpl.guard._fingerprint import decode, fingerprint, reduce_code
from refimpl.launch import spawn

AR = "all_reduce"


def _run(plan: list, world: int = 2) -> list[dict]:  # type: ignore[type-arg]
    return spawn(guard_workers.guarded_calls, world, plan, timeout_s=40, pg_timeout_s=10)


def test_matching_calls_pass_and_are_counted() -> None:
    calls = [
        (AR, "a", [2], "float32"),
        ("broadcast", "b", [3], "int64"),
        ("barrier", "c", [], "float32"),
        ("all_gather", "d", [1], "float64"),
    ]
    for res in _run([calls, calls, calls], world=3):
        assert res == {"done": 4, "error": None, "calls": []}


DISAGREEMENTS = [
    (
        (AR, "val/acc", [2], "float64"),
        (AR, "val/loss", [2], "float64"),
        "'val/loss'",
    ),  # DETAIL misses
    ((AR, "m", [2], "float64"), (AR, "m", [3], "float64"), "float64[3]"),
    ((AR, "m", [2], "float64"), (AR, "m", [2], "float32"), "float32[2]"),
    ((AR, "m", [2], "float64"), ("broadcast", "m", [2], "float64"), "broadcast (src=0)"),
    ((AR, "m", [2], "float64"), ("all_reduce_max", "m", [2], "float64"), "(MAX)"),
    ((AR, "m", [2], "float64"), ("barrier", "m", [], "float64"), "barrier"),
    # issue 19 item 10: ops and dtypes outside the old tables
    (("all_reduce_band", "m", [2], "int64"), ("all_reduce_bor", "m", [2], "int64"), "(BOR)"),
    ((AR, "m", [2], "uint16"), (AR, "m", [2], "uint32"), "uint32[2]"),
    ((AR, "m", [2], "float8_e4m3fn"), (AR, "m", [2], "float8_e5m2"), "float8_e5m2[2]"),
]


@pytest.mark.parametrize(("mine", "theirs", "shown"), DISAGREEMENTS)
def test_each_kind_of_disagreement_is_caught_on_every_rank(
    mine: tuple, theirs: tuple, shown: str
) -> None:  # type: ignore[type-arg]
    ok = (AR, "first", [1], "float32")
    results = _run([[ok, mine], [ok, theirs]])
    for rank, res in enumerate(results):
        assert res["done"] == 1, res  # the first call agreed; the second was stopped before it ran
        assert f"(this is rank {rank})" in res["error"]
        assert res["calls"][0].startswith("rank 0: call #1") and res["calls"][1].startswith(
            "rank 1: call #1"
        )
        assert shown in res["calls"][1] and shown not in res["calls"][0]


def test_the_reference_guard_and_the_fast_one_give_the_same_verdicts() -> None:
    """ReferenceGuard (one all-gather of the fingerprint) is the definition; CollectiveGuard,
    on its host and its gloo path, must say the same for the same calls: the same mismatch
    message and calls on every rank, and no error where the calls agree."""
    ok = (AR, "first", [1], "float32")
    agreeing = [
        [[ok, (AR, "m", [2], "float64")]] * 2,  # carried inside the exchange by the fast guard
        [[("broadcast", "b", [3], "int64"), ("barrier", "c", [], "float32")]] * 2,
        [[(AR, "big", [64], "float64")]] * 2,  # 512 bytes: the check, then the all-reduce
    ]
    disagreeing = [[[ok, mine], [ok, theirs]] for mine, theirs, _ in DISAGREEMENTS]
    cases = agreeing + disagreeing
    per_rank = spawn(guard_workers.verdicts_of_each_guard, 2, cases, timeout_s=90)
    for verdicts in per_rank:
        assert len(verdicts) == len(cases)
        for i, v in enumerate(verdicts):
            assert v["fast"] == v["fast_gloo"] == v["reference"], (i, v)
            assert (v["reference"] is None) == (i < len(agreeing)), (i, v)


def test_one_rank_out_of_three_disagreeing_stops_all_three() -> None:
    # each rank compares every rank's gathered fingerprint with its own: the two that agree
    # with each other still see the third
    ok, a, b = (
        (AR, "first", [1], "float32"),
        (AR, "val/acc", [2], "float64"),
        (AR, "val/f1", [2], "float64"),
    )
    results = _run([[ok, a], [ok, a], [ok, b]], world=3)
    for rank, res in enumerate(results):
        assert res["done"] == 1 and f"(this is rank {rank})" in res["error"], res
        assert [c.split(" ", 2)[2] for c in res["calls"]] == [
            "call #1 all_reduce (SUM) 'val/acc' float64[2]",
            "call #1 all_reduce (SUM) 'val/acc' float64[2]",
            "call #1 all_reduce (SUM) 'val/f1' float64[2]",
        ]


def test_a_rank_with_fewer_calls_is_reported_with_each_ranks_last_call() -> None:
    a = (AR, "seg/loss", [2], "float64")
    results = _run([[a, a, (AR, "seg/boundary", [2], "float64")], [a, a]])
    assert results[1] == {"done": 2, "error": None, "calls": []}  # rank 1 finished and left
    err = results[0]["error"]
    # rank 1 had left: rank 0's exchange failed at once, and says so (not "waited 3 s")
    assert "rank 0 reached all_reduce 'seg/boundary' (call #2) after its peers had left" in err
    # rank 1 left no record: its last call is the last one every rank passed together
    assert "rank 1 last passed call #1 all_reduce (SUM) 'seg/loss' float64[2], then no" in err
    assert results[0]["calls"] == [
        "rank 0: call #2 all_reduce (SUM) 'seg/boundary' float64[2]",
        "rank 1: call #1 all_reduce (SUM) 'seg/loss' float64[2]",
    ]


def test_calls_that_agree_leave_nothing_in_the_store() -> None:
    # the store is written only by a rank whose exchange failed: no round trip per call
    assert spawn(guard_workers.store_keys_after_agreeing_calls, 2, 5) == [[], []]


def test_guard_off_is_a_plain_collective() -> None:
    # what the guard is for: with it off, different metrics are summed into one number
    assert spawn(guard_workers.guard_switched_off_pairs_silently, 2) == [3.0, 3.0]


def test_environment_switch_turns_the_guard_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFIMPL_GUARD", "0")
    assert not CollectiveGuard().enabled
    monkeypatch.delenv("REFIMPL_GUARD")
    assert CollectiveGuard().enabled  # no process group: checks are skipped, the guard is on


def test_fingerprint_round_trip_and_long_names() -> None:
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    fp = fingerprint(7, "all_reduce", "tâche/ünïcode", t, 4)
    assert len(fp) == FINGERPRINT_LEN
    call = decode(2, fp)
    assert (call.rank, call.seq, call.op, call.name, call.dtype, call.shape) == (
        2,
        7,
        "all_reduce",
        "tâche/ünïcode",
        "bfloat16",
        (3, 4),
    )
    assert str(call) == "rank 2: call #7 all_reduce (MAX) 'tâche/ünïcode' bfloat16[3x4]"
    long_a, long_b = "x" * 200 + "a", "x" * 200 + "b"  # equal in the first 112 bytes
    assert fingerprint(0, "barrier", long_a, None, 0) != fingerprint(0, "barrier", long_b, None, 0)
    assert decode(0, [0] * FINGERPRINT_LEN).name == "<not a guard fingerprint>"
    with pytest.raises(ValueError, match="at most 8"):
        fingerprint(0, "all_reduce", "deep", torch.zeros([1] * 9), 0)


def test_chapter_loop_guarded_stops_at_the_first_divergent_step() -> None:
    res = spawn(mt.multitask_loop, 2, 8, kwargs={"guard": True}, pg_timeout_s=5, timeout_s=40)
    for r in res:
        assert r["error"].startswith("CollectiveMismatch: ranks disagree on collective #0")
    fixed = spawn(mt.multitask_loop, 2, 8, kwargs={"guard": True, "fixed": True}, timeout_s=40)
    assert [r["error"] for r in fixed] == [None, None]
    assert [c["name"] for c in fixed[0]["calls"]] == [c["name"] for c in fixed[1]["calls"]]
    # and the synced numbers are the true global means on every rank
    truth = mt.true_means(fixed)
    for r in fixed:
        assert {k: s / c for k, (s, c) in sorted(r["synced"].items())} == pytest.approx(truth)


# --- issue 19 item 10: every reduce op and every dtype is told apart ----------------------


@pytest.mark.filterwarnings("ignore:(ComplexHalf|torch.quantize):UserWarning")  # empty() of them
def test_every_dtype_and_reduce_op_has_its_own_fingerprint() -> None:
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    seen = {}
    for dtype in dtypes:
        fp = fingerprint(0, "all_reduce", "m", torch.empty(0, dtype=dtype), 0)
        assert decode(0, fp).dtype == str(dtype).removeprefix("torch.")
        seen[tuple(fp)] = dtype
    assert len(seen) == len(dtypes)  # no two dtypes share a fingerprint
    ops = dist.ReduceOp.RedOpType.__members__
    fps = set()
    for name, op in ops.items():
        for given in (op, dist.ReduceOp(op) if name != "PREMUL_SUM" else op):
            fp = fingerprint(0, "all_reduce", "m", torch.zeros(1), reduce_code(given))
            assert decode(0, fp).detail == f"({name})"
            fps.add(tuple(fp))
    assert len(fps) == len(ops)


# --- issue 19 item 11: the guard's timeout, and a rank that arrives after the others left ----


def test_the_guard_defaults_to_the_groups_timeout() -> None:
    # a guard with its own shorter limit would kill a healthy job whose rank 0 saves for
    # longer than that limit while the group itself would have waited
    assert spawn(guard_workers.guard_default_timeout, 2, pg_timeout_s=7) == [(7.0, 7.0)] * 2


def test_a_rank_arriving_after_its_peers_gave_up_says_so() -> None:
    rank0, rank1 = spawn(guard_workers.rank0_arrives_late, 2, 2.5, timeout_s=40)
    assert rank1.startswith("rank 1 waited 1 s at all_reduce 'after/save' (call #0)"), rank1
    assert "waited" not in rank0.splitlines()[0], rank0
    head = re.match(
        r"rank 0 arrived at all_reduce 'after/save' \(call #0\) ([0-9.]+) s late, "
        r"after its peers gave up",
        rank0,
    )
    assert head is not None, rank0
    assert float(head.group(1)) >= 1.5  # it slept 2.5 s before the call that rank 1 made at once
    # rank 1 left its call in the store when it gave up; rank 0's report shows it
    assert "rank 1: call #0 all_reduce (SUM) 'after/save' float32[1]  <- waited here, gave up" in (
        rank0
    )


# --- issue 22 item 4: a small all-reduce travels inside the check -------------------------


def test_a_carried_all_reduce_gives_what_dist_all_reduce_gives_on_every_rank() -> None:
    ops = ["SUM", "PRODUCT", "MIN", "MAX"]
    dtypes = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8"]
    two = spawn(guard_workers.carried_against_plain, 2, ops, dtypes, timeout_s=60)
    # two ranks: a + b in either order, so bit for bit what gloo gives
    assert all(equal for _, _, equal, _ in two[0] + two[1]), [r for r in two[0] if not r[2]]
    three = spawn(guard_workers.carried_against_plain, 3, ops, ["float64", "int64"])
    # three ranks: the same bits on every rank (summed in rank order on each)
    assert three[0] == three[1] == three[2]
    assert all(equal for op, dtype, equal, _ in three[0] if dtype == "int64" or op != "SUM")


def test_a_guarded_metric_all_reduce_is_one_collective() -> None:
    counts = spawn(guard_workers.collectives_per_guarded_call, 2, False)
    for c in counts:
        # the 16 B calls: one all-gather each; 1 MiB: the check, then the all-reduce, in the
        # guard's own group (a CPU tensor); nothing in WORLD, where unguarded calls go
        assert c["calls"] == {"other gloo:all_gather": 4, "other gloo:all_reduce": 1}, c
        # building it: the host exchange's set-up runs anyway (socket names, then the vote),
        # so ranks that pass different host_exchange values still agree
        assert c["built"] == {"other gloo:all_gather": 1, "other gloo:all_reduce": 1}, c


def test_on_one_host_the_check_is_no_collective() -> None:
    for c in spawn(guard_workers.collectives_per_guarded_call, 2, True):
        # the names of the ranks' sockets (all-gather) and the vote to use them (all-reduce);
        # then the metrics travel over the sockets and only the 1 MiB all-reduce is gloo's
        assert c["built"] == {"other gloo:all_gather": 1, "other gloo:all_reduce": 1}, c
        assert c["calls"] == {"other gloo:all_reduce": 1}, c


def test_the_device_is_part_of_the_fingerprint() -> None:
    cpu = fingerprint(0, "all_reduce", "m", torch.zeros(2), 0)
    meta = fingerprint(0, "all_reduce", "m", torch.zeros(2, device="meta"), 0)
    assert cpu != meta  # a CPU tensor carried on one rank, a CUDA one reduced on another: caught
    assert str(decode(0, meta)) == "rank 0: call #0 all_reduce (SUM) 'm' meta:float32[2]"
    assert str(decode(0, cpu)) == "rank 0: call #0 all_reduce (SUM) 'm' float32[2]"


def test_carried_all_reduce_of_views_and_tensors_that_require_grad() -> None:
    for res in spawn(guard_workers.carried_odd_tensors, 2):
        assert res == [True, True, True, True]
