"""The resharded-load benchmark of chapter 8 (``python -m refimpl.bench reshard``): every
(saved at, loaded at) pair of 2, 3 and 4 ranks is timed and checked against the saved
weights, and the like-for-like ratios are reported at each loading world size."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from refimpl.bench.reshard import READERS, WORLDS, _paired, _same, draw, main


@pytest.mark.slow
def test_reshard_benchmark_times_and_checks_every_pair(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "--size-mb", "1", "--d", "128", "--repeats", "5"]) == 0
    data = json.loads((tmp_path / "reshard.json").read_text())
    pairs = {(r["reader"], r["saved_at"], r["loaded_at"]) for r in data["rows"]}
    assert pairs == {(x, a, w) for x in READERS for a in WORLDS for w in WORLDS}
    for r in data["rows"]:
        assert r["bytes"] == 1 << 20 and r["load_s"]["n"] == 5 and r["cpu_s"]["n"] == 5
        for timing in (r["load_s"], r["cpu_s"]):
            assert 0 < timing["min"] <= timing["median"] <= timing["max"]
        assert r["mb_per_s"] == 1 / r["load_s"]["median"]
    for table in ("ratios", "cpu_ratios", "dcp_reader_ratios"):  # one per resharded pair
        assert len(data[table]) == len(WORLDS) * (len(WORLDS) - 1)
        for ratio in data[table].values():
            assert ratio["n"] == 5 and 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    goal = all(r["median"] >= 0.8 for r in data["ratios"].values())
    assert data["weights_equal"] and data["goal_met"] == goal
    assert (tmp_path / "reshard.png").stat().st_size > 0
    assert not (tmp_path / "reshard-ckpts").exists()


def test_paired_ratios_are_taken_round_by_round() -> None:
    """Round i's same-world time over round i's resharded time: a slow round slows both."""
    same, resharded = [1.0, 2.0, 4.0, 1.0, 1.0], [2.0, 4.0, 8.0, 1.0, 0.5]
    assert _paired(same, resharded) == {"median": 0.5, "min": 0.5, "max": 2.0, "n": 5.0}


def test_the_weight_check_tells_a_reordered_sum_from_other_weights() -> None:
    rng = random.Random(0)
    parts = [rng.random() for _ in range(10_000)]
    forwards, backwards = sum(parts), sum(reversed(parts))
    assert forwards != backwards  # another world size sums in another order
    assert _same([forwards, 2.0], [backwards, 2.0])
    assert not _same([forwards, 2.0], [forwards, 2.0 + 1e-6])
    assert not _same([forwards], None)


def test_draw_leaves_out_the_before_series_when_asked() -> None:
    """Chapter 8 shows refimpl's reader only; the command's own figure keeps both series."""
    from matplotlib.figure import Figure

    bench = json.loads((Path(__file__).parents[1] / "book/figures/reshard.json").read_text())
    pairs = len(bench["ratios"])
    for with_before, bars in ((True, 2 * pairs), (False, pairs)):
        ax = Figure().subplots()
        draw(bench, ax, with_before=with_before)
        assert len(ax.patches) == bars
        labels = ax.get_legend_handles_labels()[1]
        assert any(label.startswith("before") for label in labels) == with_before
        assert any(label.startswith("now") for label in labels) == with_before
