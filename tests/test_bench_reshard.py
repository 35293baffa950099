"""The resharded-load benchmark of chapter 8 (``python -m refimpl.bench reshard``): every
(saved at, loaded at) pair of 2, 3 and 4 ranks is timed and checked against the saved
weights, and the like-for-like ratios are reported at each loading world size."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from refimpl.bench.reshard import WORLDS, _same, main


@pytest.mark.slow
def test_reshard_benchmark_times_and_checks_every_pair(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "--size-mb", "1", "--d", "128", "--repeats", "5"]) == 0
    data = json.loads((tmp_path / "reshard.json").read_text())
    pairs = {(r["saved_at"], r["loaded_at"]) for r in data["rows"]}
    assert pairs == {(a, w) for a in WORLDS for w in WORLDS}
    for r in data["rows"]:
        assert r["bytes"] == 1 << 20 and r["load_s"]["n"] == 5
        assert r["load_s"]["min"] <= r["load_s"]["median"] <= r["load_s"]["max"]
        assert r["mb_per_s"] == 1 / r["load_s"]["median"]
    assert len(data["ratios"]) == len(WORLDS) * (len(WORLDS) - 1)
    assert data["weights_equal"] and isinstance(data["goal_met"], bool)
    assert (tmp_path / "reshard.png").stat().st_size > 0
    assert not (tmp_path / "reshard-ckpts").exists()


def test_the_weight_check_tells_a_reordered_sum_from_other_weights() -> None:
    rng = random.Random(0)
    parts = [rng.random() for _ in range(10_000)]
    forwards, backwards = sum(parts), sum(reversed(parts))
    assert forwards != backwards  # another world size sums in another order
    assert _same([forwards, 2.0], [backwards, 2.0])
    assert not _same([forwards, 2.0], [forwards, 2.0 + 1e-6])
    assert not _same([forwards], None)
