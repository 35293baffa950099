"""The saving-overhead benchmark of chapter 9 (``python -m refimpl.bench save --sizes-mb``):
its rows hold every method with blocking <= total, and what each async method saved loads
back equal to the state (a benchmark that timed a broken save would be worthless)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from refimpl.bench._save_overhead import METHODS, make_stager
from refimpl.bench.save import main


@pytest.mark.slow
def test_overhead_benchmark_rows_ratios_and_plot(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path), "--sizes-mb", "2", "4", "--repeats", "5", "--quiet"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "save.json").read_text())
    rows = data["rows"]
    assert {r["method"] for r in rows} == set(METHODS)
    assert {r["bytes"] for r in rows} == {2 << 20, 4 << 20}
    for r in rows:
        assert r["repeats"] == 5
        assert r["blocking_s_min"] <= r["blocking_s_median"] <= r["blocking_s_max"]
        assert r["blocking_s_median"] <= r["total_s_median"] * 1.0001, r["method"]
        if not r["method"].startswith("dcp_async"):  # synchronous: blocked for all of it
            assert r["blocking_s_median"] == r["total_s_median"]
    assert set(data["ratios"]) == {"2", "4"} and set(data["train_step"]) == {"2", "4"}
    assert data["train_step"]["2"]["steps_during_save"] >= 1
    assert set(data["goals_met"]["2"]) == set(data["goals"])
    assert (tmp_path / "save.png").stat().st_size > 0
    assert not (tmp_path / "_scratch").exists()


def test_the_reused_stager_saves_the_values_of_each_call(tmp_path: Path) -> None:
    """The staged async save reuses its buffers: each checkpoint holds the values at the
    moment of its call, although training changed them while the write was in flight."""
    from torch.distributed.checkpoint.state_dict_saver import async_save

    stager = make_stager()
    try:
        for k in range(2):
            state = {"w": torch.full((1000,), float(k))}
            future = async_save(
                {"model": state}, checkpoint_id=tmp_path / f"c{k}", no_dist=True,
                async_stager=stager,
            )  # fmt: skip
            state["w"].add_(100)  # training moves on while the write is in flight
            future.result()  # type: ignore[union-attr]
    finally:
        stager.close()
    for k in range(2):
        back = {"model": {"w": torch.empty(1000)}}
        dcp_load(back, checkpoint_id=tmp_path / f"c{k}", no_dist=True)
        assert torch.equal(back["model"]["w"], torch.full((1000,), float(k)))


def test_fewer_than_five_repeats_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="at least 5"):
        main(["--out", str(tmp_path), "--sizes-mb", "1", "--repeats", "2", "--quiet"])
