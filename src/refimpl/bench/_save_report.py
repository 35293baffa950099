"""The saving-overhead benchmark's driver: sizes, ratios against the floors, JSON and plot.

Measurements are in `refimpl.bench._save_overhead`; this module runs them for each size and
states each goal of chapter 9 as a ratio measured in the same run.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from refimpl.bench import write_json
from refimpl.bench._save_figure import overhead_figure
from refimpl.bench._save_files import FILE_WRITERS, measure_small, nanogpt_state
from refimpl.bench._save_inflight import LOW_NICE, PACED_SHARE, gil_wait, step_times
from refimpl.bench._save_inflight import WRITERS as DCP_WRITERS
from refimpl.bench._save_overhead import METHODS, make_stager, measure_size, one_rank_group
from refimpl.checkpoint import AsyncCheckpointer

__all__ = ["file_ratios", "ratios_for", "run_overhead", "step_ratios"]

SMALL_REPEATS = 15  # a small save takes milliseconds: more repeats for a stable median


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
        "dcp_async_staged_low blocking / floor_memcpy": b["dcp_async_staged_low"]
        / b["floor_memcpy"],
        "dcp_async_staged_low total / dcp_async_staged total": t["dcp_async_staged_low"]
        / t["dcp_async_staged"],
        "dcp_async_process blocking / floor_memcpy": b["dcp_async_process"] / b["floor_memcpy"],
        "dcp_async_process blocking / dcp_async_staged blocking": b["dcp_async_process"]
        / b["dcp_async_staged"],
        "dcp_async_process total / dcp_async_staged total": t["dcp_async_process"]
        / t["dcp_async_staged"],
        **file_ratios(rows),
    }


def file_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The file checkpoints' ratios (chapters 5, 6, 9) from one state's rows (medians)."""
    b = {r["method"]: r["blocking_s_median"] for r in rows}
    t = {r["method"]: r["total_s_median"] for r in rows}
    return {
        "save_checkpoint / torch_save_fsync": t["save_checkpoint"] / t["torch_save_fsync"],
        "async_checkpoint blocking / floor_memcpy": b["async_checkpoint"] / b["floor_memcpy"],
        "async_checkpoint total / save_checkpoint": t["async_checkpoint"] / t["save_checkpoint"],
    }


WRITER_NAMES = {
    "save": "thread",
    "low_save": "low-priority thread",
    "piece_save": "piecewise thread",
    "paced_save": "paced thread",
    "process_save": "process",
    "file_save": "file thread",
    "file_low_save": "file low-priority thread",
    "file_paced_save": "file paced thread",
}


def step_ratios(steps: dict[str, float]) -> dict[str, float]:
    """Training step time with a save in flight over the step alone (medians), per writer."""
    alone = steps["step_s_median_alone"]
    return {
        f"train step during {name} save / alone": steps[f"step_s_median_during_{kind}"] / alone
        for kind, name in WRITER_NAMES.items()
    }


GOALS = {  # ratio name: (comparison, bound)
    "dcp_async_staged blocking / floor_memcpy": ("<=", 1.25),
    "train step during paced thread save / alone": ("<=", 1.10),
    "dcp_sync throughput / floor_write_fsync throughput": (">=", 0.8),
    "atomic_save / torch_save_fsync": ("<=", 1.10),
    "save_checkpoint / torch_save_fsync": ("<=", 1.10),
    "async_checkpoint blocking / floor_memcpy": ("<=", 1.25),
    "train step during file paced thread save / alone": ("<=", 1.10),
}
SMALL_GOALS = {"save_checkpoint / torch_save_fsync": ("<=", 1.25)}  # the nanoGPT-like state


def _plot(data: dict[str, Any], out: Path) -> Path:
    path = out / "save.png"
    overhead_figure(data).savefig(path, dpi=150)  # a pyplot-free Figure: no backend needed
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
    gil: dict[str, dict[str, float]] = {}
    total_work = len(sizes_mb) * (repeats + 1) * len(METHODS)
    load_at_start = os.getloadavg()[0]
    try:
        bar = tqdm(total=total_work, disable=quiet, desc="save", unit="save")
        with bar, one_rank_group(scratch):
            for mb in sizes_mb:
                state = _state(mb)
                rows += measure_size(state, scratch, repeats, bar)
                thread, shared = make_stager(), make_stager(shared=True)
                stagers = {kind: thread for kind in DCP_WRITERS} | {"process_save": shared}
                savers = {
                    kind: AsyncCheckpointer(
                        scratch / kind,
                        keep_last=None,
                        writer_nice=nice,
                        writer_cpu_share=share,
                        wait_on_sigterm=False,
                    )
                    for kind, (nice, share) in FILE_WRITERS.items()
                }
                try:
                    steps[str(mb)] = step_times(state, scratch, stagers, file_savers=savers)
                    gil[str(mb)] = gil_wait(state, scratch, stagers)
                finally:
                    thread.close()
                    shared.close()
                    for saver in savers.values():
                        saver.close()
            small = measure_small(nanogpt_state(), scratch, max(repeats, SMALL_REPEATS))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = {str(mb): ratios_for([r for r in rows if r["bytes"] == mb << 20]) for mb in sizes_mb}
    for size, r in ratios.items():
        r.update(step_ratios(steps[size]))
    small_ratios = file_ratios(small)
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
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),  # intra-op threads of the training steps
            "note": "one process (plus DCP's checkpoint daemon), CPU tensors, local disk; "
            "shared machine: compare ratios",
            "load_average_1min": [load_at_start, os.getloadavg()[0]],  # at start, at end
        },
        "low_priority_nice": LOW_NICE,
        "paced_cpu_share": PACED_SHARE,
        "rows": rows,
        "ratios": ratios,
        "goals": {name: f"{op} {bound}" for name, (op, bound) in GOALS.items()},
        "goals_met": met,
        "train_step": steps,
        "gil_wait": gil,
        "small_state": {
            "note": "a nanoGPT-like state: about 10 MB over 14 top-level keys",
            "rows": small,
            "ratios": small_ratios,
            "goals": {name: f"{op} {bound}" for name, (op, bound) in SMALL_GOALS.items()},
            "goals_met": {
                name: (small_ratios[name] <= bound if op == "<=" else small_ratios[name] >= bound)
                for name, (op, bound) in SMALL_GOALS.items()
            },
        },
    }
    path = write_json(out, "save", data)
    png = _plot(data, out)
    print(f"nanoGPT-like state ({small[0]['bytes'] / 1e6:.1f} MB, {small[0]['keys']} keys):")
    for name, value in small_ratios.items():
        print(f"  {name:>52}: {value:.2f}")
    for size, r in ratios.items():
        print(f"{size} MiB:")
        for name, value in r.items():
            print(f"  {name:>52}: {value:.2f}")
    print(f"wrote {path} and {png}")
    return 0
