"""``python -m refimpl.bench guard --out DIR``: what checking each collective costs.

Per all-reduce, side by side on the same 2 gloo ranks: a plain ``dist.all_reduce``,
`refimpl.guard.CollectiveGuard` on, the guard switched off (``enabled=False``), and, in a
second job started with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, the same plain all-reduce, which
PyTorch's wrapper now checks (a gloo collective of its fingerprint before each call). Two
message sizes: a metric (2 float64) and 1 MiB. The memcpy of the same bytes is the floor.
Writes ``guard.json`` and ``guard.png``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refimpl.bench import summarize, write_json
from refimpl.demos.multitask import environment
from refimpl.guard import CollectiveGuard
from refimpl.launch import spawn

SIZES = {"metric (16 B)": 2, "1 MiB": 2**17}  # float64 elements
CALLS_PER_SAMPLE = 100


def _per_call(op: Callable[[], Any], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CALLS_PER_SAMPLE):
            op()
        samples.append((time.perf_counter() - start) / CALLS_PER_SAMPLE)
    return samples


def measure(repeats: int, detail: bool) -> dict[str, Any]:
    """Worker: per-call seconds of each method at each size (``detail``: the DETAIL job)."""
    guard_on = CollectiveGuard()
    guard_off = CollectiveGuard(enabled=False)
    out: dict[str, Any] = {}
    for label, numel in SIZES.items():
        t = torch.ones(numel, dtype=torch.float64)
        dest = torch.empty_like(t)
        for _ in range(5):  # warm-up: connections, buffers
            dist.all_reduce(t)
            guard_on.all_reduce(t, name="warm-up")
        row = {"plain": summarize(_per_call(partial(dist.all_reduce, t), repeats))}
        if not detail:
            on = partial(guard_on.all_reduce, t, name="val/acc")
            off = partial(guard_off.all_reduce, t, name="val/acc")
            row["guard"] = summarize(_per_call(on, repeats))
            row["guard_off"] = summarize(_per_call(off, repeats))
            row["memcpy"] = summarize(_per_call(partial(dest.copy_, t), repeats))
        out[label] = row
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Bars of the median per-call time of each method, one group per message size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [
        ("plain", "all_reduce"),
        ("guard_off", "guard off"),
        ("guard", "CollectiveGuard"),
        ("detail", "DETAIL"),
    ]
    fig, axes = plt.subplots(1, len(SIZES), figsize=(9, 3.6))
    for ax, label in zip(axes, SIZES, strict=True):
        row = result["rows"][label]
        vals = [row[k]["median"] * 1e6 for k, _ in methods]
        ax.bar([m for _, m in methods], vals, color=["C0", "C7", "C1", "C3"])
        ax.set_title(label)
        ax.set_ylabel("µs per call (median)")
        ax.tick_params(axis="x", rotation=35)
    fig.suptitle(f"per-collective cost on {result['world_size']} gloo ranks (this 2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m refimpl.bench guard")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians of fewer are noise)")
    world = 2
    plain = spawn(measure, world, args.repeats, False, timeout_s=600)[0]
    with environment(TORCH_DISTRIBUTED_DEBUG="DETAIL"):
        detail = spawn(measure, world, args.repeats, True, timeout_s=600)[0]
    rows = {}
    for label in SIZES:
        row = dict(plain[label])
        row["detail"] = detail[label]["plain"]  # under DETAIL every all_reduce is checked
        p = row["plain"]["median"]
        row["guard_over_plain"] = row["guard"]["median"] / p
        row["guard_off_over_plain"] = row["guard_off"]["median"] / p
        row["detail_over_plain"] = row["detail"]["median"] / p
        row["guard_added_us"] = (row["guard"]["median"] - p) * 1e6
        row["detail_added_us"] = (row["detail"]["median"] - p) * 1e6
        rows[label] = row
    result = {
        "world_size": world,
        "repeats": args.repeats,
        "calls_per_sample": CALLS_PER_SAMPLE,
        "rows": rows,
    }
    path = write_json(args.out, "guard", result)
    plot(result, args.out / "guard.png")
    for label, row in rows.items():
        print(
            f"{label:>14}: all_reduce {row['plain']['median'] * 1e6:7.1f} µs | guard "
            f"{row['guard_over_plain']:.2f}x (+{row['guard_added_us']:.0f} µs) | guard off "
            f"{row['guard_off_over_plain']:.2f}x | DETAIL {row['detail_over_plain']:.2f}x "
            f"(+{row['detail_added_us']:.0f} µs) | memcpy {row['memcpy']['median'] * 1e6:.1f} µs"
        )
    print(f"wrote {path} and {args.out / 'guard.png'}")
    return 0
