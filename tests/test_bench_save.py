"""The saving-overhead benchmark of chapter 9 (``python -m refimpl.bench save --sizes-mb``):
its rows hold every method with blocking <= total, and what each async method saved loads
back equal to the state (a benchmark that timed a broken save would be worthless)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _async_process_executor
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from refimpl.bench._save_files import FILE_METHODS, nanogpt_state
from refimpl.bench._save_overhead import METHODS, make_stager, one_rank_group
from refimpl.bench.save import main

FILE_RATIOS = (
    "save_checkpoint / torch_save_fsync",
    "async_checkpoint blocking / floor_memcpy",
    "train step during file thread save / alone",
    "train step during file paced thread save / alone",
)


@pytest.mark.slow
def test_overhead_benchmark_rows_ratios_and_plot(tmp_path: Path) -> None:
    # One small size: the JSON's shape per size is what is checked here (two sizes cost twice
    # the CPU and check the same code); the committed run has two, and the figure and table
    # tests read that.
    argv = ["--out", str(tmp_path), "--sizes-mb", "2", "--repeats", "5", "--quiet"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "save.json").read_text())
    rows = data["rows"]
    assert {r["method"] for r in rows} == set(METHODS)
    assert {r["bytes"] for r in rows} == {2 << 20}
    for r in rows:
        assert r["repeats"] == 5
        assert r["blocking_s_min"] <= r["blocking_s_median"] <= r["blocking_s_max"]
        assert r["blocking_s_median"] <= r["total_s_median"] * 1.0001, r["method"]
        if not r["method"].startswith(("dcp_async", "async_")):  # synchronous: blocked for all
            assert r["blocking_s_median"] == r["total_s_median"]
    assert set(data["ratios"]) == {"2"} and set(data["train_step"]) == {"2"}
    kinds = ("save", "low_save", "piece_save", "paced_save", "process_save")
    for kind in kinds:
        assert data["train_step"]["2"][f"steps_during_{kind}"] >= 1, kind
    for size, ratios in data["ratios"].items():  # thread vs process, side by side, per size
        for name in (
            "dcp_async_process blocking / floor_memcpy",
            "dcp_async_process blocking / dcp_async_staged blocking",
            "dcp_async_process total / dcp_async_staged total",
            "dcp_async_staged_low blocking / floor_memcpy",
            "dcp_async_staged_low total / dcp_async_staged total",
            "train step during thread save / alone",
            "train step during low-priority thread save / alone",
            "train step during piecewise thread save / alone",
            "train step during paced thread save / alone",
            "train step during process save / alone",
        ):
            assert math.isfinite(ratios[name]) and ratios[name] > 0, (size, name)
        steps = data["train_step"][size]
        for kind in ("alone", *(f"during_{k}" for k in kinds)):
            lo, mid, hi = (steps[f"step_s_{s}_{kind}"] for s in ("min", "median", "max"))
            assert 0 < lo <= mid <= hi, (size, kind)
        for kind in kinds[:-1]:  # the writing thread's CPU time, measured in it
            assert 0 < steps[f"writer_cpu_s_median_{kind}"] < steps[f"save_s_median_{kind}"]
        assert "writer_cpu_s_median_process_save" not in steps  # not measurable from here
        if sys.platform == "linux":  # a spinning thread's wait for the GIL, from schedstat
            gil = data["gil_wait"][size]
            assert set(gil) == {f"gil_wait_fraction_{k}" for k in kinds}
            assert all(0 <= v < 1 for v in gil.values()), gil
    for size, ratios in data["ratios"].items():  # the file checkpoints, side by side
        for name in FILE_RATIOS:
            assert math.isfinite(ratios[name]) and ratios[name] > 0, (size, name)
        assert data["train_step"][size]["steps_during_file_paced_save"] >= 1
    small = data["small_state"]  # the nanoGPT-like state: 14 keys, about 10 MB
    assert {r["method"] for r in small["rows"]} == set(FILE_METHODS)
    assert all(r["keys"] == 14 and 8e6 < r["bytes"] < 12e6 for r in small["rows"])
    assert set(small["goals_met"]) == {"save_checkpoint / torch_save_fsync"}
    # the benchmark's one-rank group and DCP's checkpoint daemon are gone afterwards
    assert not dist.is_initialized()
    assert _async_process_executor._CHECKPOINT_PROCESS is None
    assert set(data["goals_met"]["2"]) == set(data["goals"])
    assert (tmp_path / "save.png").stat().st_size > 0
    assert not (tmp_path / "_scratch").exists()


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_the_reused_stager_saves_the_values_of_each_call(tmp_path: Path, process: bool) -> None:
    """The staged async save reuses its buffers: each checkpoint holds the values at the
    moment of its call, although training changed them while the write was in flight; the
    same through DCP's checkpoint daemon, which maps the shared-memory staging buffers."""
    from torch.distributed.checkpoint.state_dict_saver import async_save

    kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    stager = make_stager(shared=process)
    try:
        with one_rank_group(tmp_path / "pg"):
            for k in range(2):
                state = {"w": torch.full((1000,), float(k))}
                future = async_save(
                    {"model": state},
                    checkpoint_id=tmp_path / f"c{k}",
                    no_dist=True,
                    async_stager=stager,
                    async_checkpointer_type=kind,
                )
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


def test_the_figures_leave_pyplot_and_its_backend_alone() -> None:
    """The chapter's figures are plain ``Figure`` objects: drawing them neither picks a
    backend (``matplotlib.use("Agg")`` would turn a notebook's inline figures off) nor
    registers a pyplot figure that a notebook would show a second time."""
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from refimpl.bench._save_figure import blocking_estimate_figure, overhead_figure

    def row(method: str, nbytes: int, blocked: float, total: float) -> dict[str, object]:
        return {
            "method": method,
            "bytes": nbytes,
            "blocking_s_median": blocked,
            "blocking_s_min": blocked * 0.9,
            "blocking_s_max": blocked * 1.2,
            "total_s_median": total,
            "total_s_min": total * 0.9,
            "total_s_max": total * 1.1,
        }

    data = {
        "rows": [
            row(m, n << 20, b * n / 256, t * n / 256)
            for n in (256, 1024)
            for m, b, t in [("floor_memcpy", 0.03, 0.03), ("dcp_async_staged", 0.04, 0.5)]
        ]
    }
    backend, before = matplotlib.get_backend(), plt.get_fignums()
    figures = [overhead_figure(data), blocking_estimate_figure(14.3, 1.0, 20.0)]
    assert all(isinstance(f, Figure) for f in figures)
    assert [len(f.axes) for f in figures] == [2, 1]
    assert matplotlib.get_backend() == backend and plt.get_fignums() == before


def test_the_table_fits_a_book_page_with_one_line_per_method() -> None:
    from refimpl.bench._save_figure import LABELS, overhead_table

    data = json.loads((Path(__file__).parents[1] / "book/figures/save.json").read_text())
    lines = overhead_table(data).splitlines()
    methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
    assert len(lines) == 2 + len(methods)  # two header lines, then a row per method
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    for line, method in zip(lines[2:], methods, strict=True):
        assert line.startswith(LABELS[method].replace("\n", " ")), (line, method)
        seconds = re.findall(r"\d\.\d{3} s", line)  # blocked and total per size
        assert len(seconds) == 2 * len(data["ratios"]), line


def test_the_nanogpt_like_state_has_14_keys_about_10_mb_and_round_trips(tmp_path: Path) -> None:
    """The benchmark's small state is what the issue measured: 14 top-level keys, ~10 MB,
    tied embedding weights, and it saves and loads back through a file checkpoint."""
    from refimpl.bench._save_files import tensors_of
    from refimpl.checkpoint import load_checkpoint, save_checkpoint

    state = nanogpt_state()
    assert len(state) == 14
    assert 8e6 < sum(t.numel() * t.element_size() for t in tensors_of(state)) < 12e6
    loaded = load_checkpoint(save_checkpoint(tmp_path, state, 1))
    assert loaded["iter_num"] == 2000 and loaded["config"] == state["config"]
    for name, value in state["model"].items():
        assert torch.equal(loaded["model"][name], value), name
