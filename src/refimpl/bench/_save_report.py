"""The saving-overhead benchmark's driver: sizes, ratios against the floors, JSON and plot.

Measurements are in `refimpl.bench._save_overhead`; this module runs them for each size and
states each goal of chapter 9 as a ratio measured in the same run.
"""

from __future__ import annotations

import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from refimpl.bench import write_json
from refimpl.bench._save_overhead import (
    METHODS,
    measure_size,
    one_rank_group,
    step_time_with_background_save,
)

__all__ = ["ratios_for", "run_overhead", "step_ratios"]


def _state(mb: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    per = mb * (1 << 18) // 8  # eight layer-sized float32 tensors
    return {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(8)}


def ratios_for(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The chapter's ratios for one size, from that size's rows (medians)."""
    b = {r["method"]: r["blocking_s_median"] for r in rows}
    t = {r["method"]: r["total_s_median"] for r in rows}
    return {
        "dcp_async_staged blocking / floor_memcpy": b["dcp_async_staged"] / b["floor_memcpy"],
        "dcp_async blocking / floor_memcpy": b["dcp_async"] / b["floor_memcpy"],
        "dcp_sync / dcp_async_staged blocking": t["dcp_sync"] / b["dcp_async_staged"],
        "dcp_sync throughput / floor_write_fsync throughput": t["floor_write_fsync"]
        / t["dcp_sync"],
        "atomic_save / torch_save_fsync": t["atomic_save"] / t["torch_save_fsync"],
        "floor_write_fsync / floor_memcpy": t["floor_write_fsync"] / t["floor_memcpy"],
        "dcp_async_staged total / dcp_sync": t["dcp_async_staged"] / t["dcp_sync"],
        "dcp_async_process blocking / floor_memcpy": b["dcp_async_process"] / b["floor_memcpy"],
        "dcp_async_process blocking / dcp_async_staged blocking": b["dcp_async_process"]
        / b["dcp_async_staged"],
        "dcp_async_process total / dcp_async_staged total": t["dcp_async_process"]
        / t["dcp_async_staged"],
    }


def step_ratios(steps: dict[str, float]) -> dict[str, float]:
    """Training step time with a save in flight over the step alone (medians), per writer."""
    alone = steps["step_s_median_alone"]
    return {
        "train step during thread save / alone": steps["step_s_median_during_save"] / alone,
        "train step during process save / alone": steps["step_s_median_during_process_save"]
        / alone,
    }


GOALS = {  # ratio name: (comparison, bound)
    "dcp_async_staged blocking / floor_memcpy": ("<=", 1.5),
    "dcp_sync throughput / floor_write_fsync throughput": (">=", 0.8),
    "atomic_save / torch_save_fsync": ("<=", 1.10),
}


def _plot(rows: list[dict[str, Any]], sizes: list[int], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 3.8), squeeze=False)
    for ax, mb in zip(axes[0], sizes, strict=True):
        mine = [r for r in rows if r["bytes"] == mb << 20]
        names = [r["method"] for r in mine]
        total = [r["total_s_median"] for r in mine]
        block = [r["blocking_s_median"] for r in mine]
        ax.barh(names, total, color="#c6dbef", label="total (durable on disk)")
        ax.barh(names, block, color="#2171b5", height=0.5, label="blocking (training stopped)")
        ax.invert_yaxis()
        ax.set_xlabel("seconds per save (median)")
        ax.set_title(f"{mb} MiB state")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle("What a save costs: time the training loop is blocked vs time to durable")
    fig.tight_layout()
    path = out / "save.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_overhead(
    sizes_mb: list[int], repeats: int, out: Path, scratch: Path | None, quiet: bool
) -> int:
    """Measure every method at every size; write ``save.json`` and ``save.png`` to ``out``."""
    from tqdm.auto import tqdm

    if repeats < 5:
        raise SystemExit("--repeats must be at least 5 (medians of fewer are noise)")
    scratch = scratch or out / "_scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    steps: dict[str, dict[str, float]] = {}
    total_work = len(sizes_mb) * (repeats + 1) * len(METHODS)
    try:
        bar = tqdm(total=total_work, disable=quiet, desc="save", unit="save")
        with bar, one_rank_group(scratch):
            for mb in sizes_mb:
                state = _state(mb)
                rows += measure_size(state, scratch, repeats, bar)
                steps[str(mb)] = step_time_with_background_save(state, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = {str(mb): ratios_for([r for r in rows if r["bytes"] == mb << 20]) for mb in sizes_mb}
    for size, r in ratios.items():
        r.update(step_ratios(steps[size]))
    met = {
        size: {
            name: (r[name] <= bound if op == "<=" else r[name] >= bound)
            for name, (op, bound) in GOALS.items()
        }
        for size, r in ratios.items()
    }
    data = {
        "benchmark": "saving overhead: blocking and total time per save, floors beside",
        "machine": {
            "cpus": __import__("os").cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "note": "one process (plus DCP's checkpoint daemon), CPU tensors, local disk; "
            "shared machine: compare ratios",
        },
        "rows": rows,
        "ratios": ratios,
        "goals": {name: f"{op} {bound}" for name, (op, bound) in GOALS.items()},
        "goals_met": met,
        "train_step": steps,
    }
    path = write_json(out, "save", data)
    png = _plot(rows, sizes_mb, out)
    for size, r in ratios.items():
        print(f"{size} MiB:")
        for name, value in r.items():
            print(f"  {name:>52}: {value:.2f}")
    print(f"wrote {path} and {png}")
    return 0
