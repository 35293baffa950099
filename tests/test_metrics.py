"""refimpl.metrics.sync_metrics: the same totals on every rank whatever keys each rank holds."""

from __future__ import annotations

import math

import pytest
from workers import guard as guard_workers

from refimpl.demos import multitask as mt
from refimpl.launch import WorkerError, spawn
from refimpl.metrics import MAX_KEY_BYTES, MetricTotal, sync_metrics


def test_without_a_process_group_it_returns_the_local_totals() -> None:
    assert sync_metrics({"b": (3.0, 2), "a": (1.0, 1)}) == {
        "a": MetricTotal(1.0, 1),
        "b": MetricTotal(3.0, 2),
    }
    assert MetricTotal(3.0, 2).mean == 1.5
    assert MetricTotal(0.0, 0).mean != MetricTotal(0.0, 0).mean  # NaN: nothing was counted


def test_disjoint_keys_and_an_empty_rank() -> None:
    per_rank = [{"seg/iou": (1.5, 3)}, {}, {"cls/acc": (2.0, 4), "seg/iou": (0.5, 1)}]
    results = spawn(guard_workers.sync_these, 3, per_rank, timeout_s=30)
    assert results == [{"cls/acc": (2.0, 4), "seg/iou": (2.0, 4)}] * 3


def test_all_ranks_empty() -> None:
    assert spawn(guard_workers.sync_these, 2, [{}, {}], timeout_s=30) == [{}, {}]


def test_property_random_key_sets_on_three_ranks() -> None:
    # hypothesis, derandomized so every rank draws the same examples in the same order
    counts = spawn(guard_workers.sync_metrics_property, 3, 3, 120, timeout_s=150, pg_timeout_s=30)
    assert counts[0] == counts[1] == counts[2] >= 100


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_name_over_the_cap_is_one_clear_error_on_every_rank(bad_rank: int) -> None:
    out = spawn(guard_workers.too_long_name_on, 2, bad_rank, timeout_s=30)
    for me, text in enumerate(out):
        assert f"rank {bad_rank} (at least) holds" in text and f"this is rank {me}" in text
        assert str(MAX_KEY_BYTES) in text


def test_bad_input_is_refused_before_any_collective() -> None:
    with pytest.raises(TypeError, match="must be str"):
        sync_metrics({1: (1.0, 1)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"must map to \(sum, count\)"):
        sync_metrics({"a": 1.0})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="NUL"):
        sync_metrics({"a\0b": (1.0, 1)})


def test_chapter_epoch_metrics_agree_even_when_ranks_drew_different_datasets() -> None:
    res = spawn(mt.epoch_metrics, 3, 2, kwargs={"fixed": False}, timeout_s=30)
    assert len({tuple(r["keys"]) for r in res}) > 1  # the ranks really did hold different keys
    assert res[0]["totals"] == res[1]["totals"] == res[2]["totals"]
    truth = mt.true_means(res)
    assert {k: s / c for k, (s, c) in res[0]["totals"].items()} == pytest.approx(truth)


def test_a_rank_that_never_calls_is_a_timeout_not_a_silent_result() -> None:
    with pytest.raises(WorkerError):
        spawn(guard_workers.sync_on_all_but_last, 2, timeout_s=30, pg_timeout_s=2)


# --- issue 19 item 8: a bad value on one rank is one clear error on every rank ----------------

_BAD_ON_RANK_1 = [  # (what rank 1 holds, what the error must say)
    ({"acc": ("high", 1)}, "'acc'"),
    ({"acc": (math.nan, 1)}, "nan"),
    ({"acc": (math.inf, 1)}, "inf"),
    ({"acc": (1.0, -3)}, "-3"),
    ({"acc": (1.0, 2.5)}, "2.5"),
    ({"acc": (1.0, math.inf)}, "inf"),
    ({"acc": (1.0, 2**53 + 1)}, str(2**53 + 1)),
    ({"acc": (1.0, True)}, "bool"),
    ({"acc\ud800": (1.0, 1)}, "surrogate"),
    ({"acc": 1.0}, "(sum, count)"),
]


def test_a_bad_value_on_rank_1_is_the_same_clear_error_on_every_rank() -> None:
    good = {"acc": (1.0, 1), "loss": (2.0, 2)}
    cases = [[good, bad] for bad, _ in _BAD_ON_RANK_1] + [[good, good]]
    out = spawn(guard_workers.sync_each_case, 2, cases, timeout_s=60, pg_timeout_s=10)
    for i, (_, shown) in enumerate(_BAD_ON_RANK_1):
        texts = [out[r][i] for r in range(2)]
        for me, text in enumerate(texts):
            assert text.startswith("ValueError: sync_metrics: rank 1"), text
            assert shown in text and f"this is rank {me}" in text, text
        assert texts[0].replace("rank 0)", "") == texts[1].replace("rank 1)", "")
    # and the group is still in lockstep afterwards: a good case gives the true totals
    assert out[0][-1] == out[1][-1] == repr({"acc": (2.0, 2), "loss": (4.0, 4)})


def test_a_total_count_of_2_to_the_53_is_refused_not_rounded() -> None:
    # 2**53 - 1 + 2 is 2**53 + 1, which float64 rounds to 2**53: refused, not rounded
    big, two = {"n": (0.0, 2**53 - 1)}, {"n": (0.0, 2)}
    out = spawn(guard_workers.sync_each_case, 2, [[big, two]], timeout_s=60)
    for text in (out[0][0], out[1][0]):
        assert text.startswith("ValueError: sync_metrics:") and "'n'" in text, text
        assert str(2**53) in text


def test_bad_values_without_a_process_group_are_refused() -> None:
    for bad, shown in _BAD_ON_RANK_1:
        with pytest.raises((ValueError, TypeError)) as info:
            sync_metrics(bad)
        assert shown in str(info.value)
    assert sync_metrics({"n": (1, 3.0)}) == {"n": MetricTotal(1.0, 3)}  # a whole float counts
