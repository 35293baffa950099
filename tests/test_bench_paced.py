"""The 2-rank pacing benchmark of chapter 9 (``python -m refimpl.bench paced``): both kinds
of saver measured side by side in every run, each save committed, the ranks stepping
together until every rank's save is done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refimpl.bench.paced import KINDS, main


@pytest.mark.slow
def test_each_run_measures_every_kind_over_every_round(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path), "--mb", "4", "--rounds", "5", "--runs", "1", "--width", "64"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "paced.json").read_text())
    assert data["world_size"] == 2 and data["paced_cpu_share"] == KINDS["paced"]
    (run,) = data["runs"]
    assert set(run["kinds"]) == set(KINDS) == {"thread", "paced"}
    for kind, raw in run["raw"]["kinds"].items():
        for name, values in raw.items():
            assert len(values) == 5, (kind, name)  # the cold round is left out
        assert all(n >= 1 for n in raw["steps"]), kind  # steps overlapped every save
        assert all(s > 0 for s in raw["save_s"]), kind
        lost = run["kinds"][kind]["lost_s"]
        assert lost["min"] <= lost["median"] <= lost["max"]
    assert len(run["raw"]["alone_s"]) == 2 * 5 * 6  # six steps alone before each save


def test_fewer_than_five_rounds_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--rounds", "3"])
    assert "at least 5" in capsys.readouterr().err
    assert not (tmp_path / "paced.json").exists()
