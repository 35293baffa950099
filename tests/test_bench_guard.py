"""The guard benchmark of chapter 7 (``python -m refimpl.bench guard``): every method timed
at every size in interleaved repeats whose order rotates, ratios paired within a repeat."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest

from refimpl.bench.guard import METHODS, SIZES, TARGETS, main, paired, rotated

matplotlib.use("Agg")


def test_the_order_rotates_so_every_method_goes_first_in_turn() -> None:
    firsts = [rotated(METHODS, r)[0] for r in range(len(METHODS))]
    assert sorted(firsts) == sorted(METHODS)
    assert all(sorted(rotated(METHODS, r)) == sorted(METHODS) for r in range(9))


def test_ratios_are_paired_within_a_repeat() -> None:
    # a repeat that is slow for every method alike (load) leaves the paired ratio alone
    num, den = [2.0, 20.0, 4.0, 2.0, 2.0], [1.0, 10.0, 2.0, 1.0, 1.0]
    assert paired(num, den) == {"median": 2.0, "q1": 2.0, "q3": 2.0, "min": 2.0, "max": 2.0}


@pytest.mark.slow
def test_the_benchmark_writes_every_method_at_every_size(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "--repeats", "5", "--calls", "5"]) == 0
    data = json.loads((tmp_path / "guard.json").read_text())
    assert set(data["rows"]) == set(SIZES)
    for label, row in data["rows"].items():
        assert set(row["seconds"]) == set(METHODS)
        assert all(s["n"] == 5 and len(s["samples"]) == 5 for s in row["seconds"].values())
        assert set(row["over_plain"]) == set(METHODS) - {"plain"}
        ratio = row["over_plain"]["guard"]
        assert ratio["min"] <= ratio["q1"] <= ratio["median"] <= ratio["q3"] <= ratio["max"]
        assert row["target"] == TARGETS[label]
        assert row["guard_meets_target"] == (ratio["median"] <= TARGETS[label])
    assert (tmp_path / "guard.png").stat().st_size > 0
