"""refimpl.bench.torchft: restart-from-checkpoint against torchft under one kill schedule,
and the crossover of the waste model the chapter draws from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refimpl.bench.torchft import crossover, main


def test_the_crossover_is_where_the_two_wastes_meet() -> None:
    """Restart: sqrt(2 C l) + R l; torchft: o + c l. With C = 0, R = 2 and c = 1 the two
    meet where o = l (2 - 1): l = o."""
    lam = crossover(0.01, 1.0, 0.0, 2.0)
    assert lam is not None and abs(lam - 0.01) < 1e-9
    assert crossover(0.01, 3.0, 0.0, 2.0) is None  # torchft costs more per failure: never
    lam = crossover(0.05, 10.0, 60.0, 600.0)
    assert lam is not None
    assert abs((0.05 + 10 * lam) - ((2 * 60 * lam) ** 0.5 + 600 * lam)) < 1e-9


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_benchmark_kills_restarts_and_heals(tmp_path: Path) -> None:
    argv = [
        "--out",
        str(tmp_path),
        "--steps",
        "16",
        "--step-sleep",
        "0.05",
        "--intervals",
        "2",
        "--repeats",
        "1",
        "--approaches",
        "restart_sync,torchft",
        "--save-every",
        "5",
        "--no-chaos",
    ]
    assert main(argv) == 0
    data = json.loads((tmp_path / "torchft.json").read_text())
    assert sorted(data["summary"]) == ["restart_sync", "torchft"] and data["chaos"] is None
    for row in data["rows"]:
        if row["interval_s"] is None:
            assert row["kills"] == 0 and row["steps_lost"] == 0
        else:
            assert row["kills"] >= 1 and len(row["return_s"]) >= 1, row
            assert all(0 < s < 300 for s in row["return_s"]) and row["efficiency"] > 0
    assert (tmp_path / "torchft.png").stat().st_size > 0
