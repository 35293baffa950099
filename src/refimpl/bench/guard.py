"""``python -m refimpl.bench guard --out DIR``: what checking each collective costs.

Per all-reduce, side by side on the same 2 gloo ranks, in one job:

- ``plain``: ``dist.all_reduce`` in the default group;
- ``guard_off``: `refimpl.guard.CollectiveGuard` built with ``enabled=False`` (a plain
  all-reduce behind an ``if``);
- ``guard``: `CollectiveGuard` on (the fingerprint exchange, then the all-reduce); both
  ranks are on one host, so the fingerprints go over Unix datagram sockets;
- ``guard_gloo``: `CollectiveGuard` with ``host_exchange=False``: the fingerprints go in a
  gloo all-gather, as between hosts (and as the guard did on one host before);
- ``detail``: ``dist.all_reduce`` in a gloo group created while the debug level was
  ``DETAIL`` (what ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does to every group), so PyTorch's
  ``ProcessGroupWrapper`` checks each call;
- ``floor``: a bare 16-byte all-reduce, then the bare all-reduce of the message: what any
  check made of one small collective before the call costs at least;
- ``memcpy``: a copy of the same bytes into a buffer allocated once, the floor of any method.

Two message sizes: a metric (2 float64, 16 B) and 1 MiB. The methods are interleaved: every
repeat times each method once per size (a few untimed calls, a barrier, then ``--calls``
calls; the slowest rank's time per call), and the order of the methods rotates from one
repeat to the next, so load from other processes and order effects (caches, a peer still
busy with the previous method) hit every method alike. Ratios are paired: each repeat gives
one ratio per method against ``plain`` from the same repeat, and the JSON reports their
median with quartiles and range.
Writes ``guard.json`` and ``guard.png``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import DebugLevel, get_debug_level, set_debug_level

from refimpl.bench import summarize, write_json
from refimpl.guard import CollectiveGuard
from refimpl.launch import spawn

SIZES = {"metric (16 B)": 2, "1 MiB": 2**17}  # float64 elements
METHODS = ("plain", "guard_off", "guard", "guard_gloo", "detail", "floor", "memcpy")
LABELS = {
    "plain": "all_reduce",
    "guard_off": "guard off",
    "guard": "CollectiveGuard",
    "guard_gloo": "guard, gloo check",
    "detail": "DETAIL",
    "floor": "16 B first",
    "memcpy": "memcpy",
}
_TICKS = {"guard_off": "guard off", "floor": "16 B first", "guard": "Collective\nGuard"}
_TICKS["guard_gloo"] = "guard,\ngloo check"
_TICKS["detail"] = "DETAIL"
WARM_CALLS = 5
TARGETS = {"metric (16 B)": 2.0, "1 MiB": 1.15}
"""The most a guarded all-reduce may cost, as a multiple of the bare one, at each size."""


def _detail_group() -> Any:
    """A gloo group wrapped as under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: the wrapper is chosen
    when a group is created (``_new_process_group_helper`` reads the debug level), so setting
    the level around ``new_group`` gives one checked group beside unchecked ones."""
    before = get_debug_level()
    set_debug_level(DebugLevel.DETAIL)
    try:
        return dist.new_group(backend="gloo")
    finally:
        set_debug_level(before)


def _sample(op: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``op``, on the slowest rank (a collective lasts for all of them).
    A few untimed calls first: the previous sample ran another method, often in another
    group, whose threads were the ones awake; the sample times ``op`` in its steady state."""
    for _ in range(WARM_CALLS):
        op()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        op()
    elapsed = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _one_then_other(first: torch.Tensor, second: torch.Tensor) -> None:
    dist.all_reduce(first)
    dist.all_reduce(second)


def rotated(methods: Sequence[str], repeat: int) -> list[str]:
    """The order of the methods in repeat ``repeat``: each one goes first in turn."""
    k = repeat % len(methods)
    return list(methods[k:]) + list(methods[:k])


def measure(repeats: int, calls: int) -> dict[str, dict[str, list[float]]]:
    """Worker: seconds per call of every method at every size, ``repeats`` interleaved samples."""
    guard_on = CollectiveGuard()
    guard_off = CollectiveGuard(enabled=False)
    guard_gloo = CollectiveGuard(host_exchange=False)
    detail = _detail_group()
    small = torch.ones(2, dtype=torch.float64)
    ops: dict[str, dict[str, Callable[[], Any]]] = {}
    for label, numel in SIZES.items():
        t = torch.ones(numel, dtype=torch.float64)
        dest = torch.empty_like(t)
        ops[label] = {
            "plain": partial(dist.all_reduce, t),
            "guard_off": partial(guard_off.all_reduce, t, name="val/acc"),
            "guard": partial(guard_on.all_reduce, t, name="val/acc"),
            "guard_gloo": partial(guard_gloo.all_reduce, t, name="val/acc"),
            "detail": partial(dist.all_reduce, t, group=detail),
            "floor": partial(_one_then_other, small, t),
            "memcpy": partial(dest.copy_, t),
        }
        for op in ops[label].values():  # warm-up: connections, buffers, caches
            for _ in range(5):
                op()
    samples: dict[str, dict[str, list[float]]] = {s: {m: [] for m in METHODS} for s in SIZES}
    for r in range(repeats):
        for label in SIZES:
            for method in rotated(METHODS, r):
                samples[label][method].append(_sample(ops[label][method], calls))
    return samples


def paired(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and range of the per-repeat ratios ``num[i] / den[i]``."""
    ratios = sorted(a / b for a, b in zip(num, den, strict=True))
    q = statistics.quantiles(ratios, n=4)
    return {
        "median": statistics.median(ratios),
        "q1": q[0],
        "q3": q[-1],
        "min": ratios[0],
        "max": ratios[-1],
    }


def summarise(samples: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per size: each method's timings, its paired ratio to ``plain``, the guard's target."""
    rows: dict[str, Any] = {}
    for label, by_method in samples.items():
        plain = by_method["plain"]
        rows[label] = {
            "seconds": {m: summarize(s) | {"samples": s} for m, s in by_method.items()},
            "over_plain": {m: paired(s, plain) for m, s in by_method.items() if m != "plain"},
            "target": TARGETS[label],
        }
        rows[label]["guard_meets_target"] = (
            rows[label]["over_plain"]["guard"]["median"] <= TARGETS[label]
        )
    return rows


def figure(result: dict[str, Any]) -> Any:
    """Bars of the median paired ratio to a bare all-reduce, quartiles as error bars, one
    panel per message size (log scale); the guard's target as a dashed line."""
    import matplotlib.pyplot as plt

    methods = ("guard_off", "floor", "guard_gloo", "guard", "detail")
    colours = {"guard_off": "#8c8c8c", "floor": "#8da0cb", "guard": "#dd8452", "detail": "#c44e52"}
    colours["guard_gloo"] = "#e8b48f"
    rows = [(label, result["rows"][label]) for label in SIZES if label in result["rows"]]
    fig, axes = plt.subplots(1, len(rows), figsize=(8, 3.4), sharey=True)
    top = max(row["over_plain"][m]["q3"] for _, row in rows for m in methods)
    bottom = min(0.3, 0.7 * min(row["over_plain"][m]["q1"] for _, row in rows for m in methods))
    for ax, (label, row) in zip(axes, rows, strict=True):
        stats = [row["over_plain"][m] for m in methods]
        med = [s["median"] for s in stats]
        err = [[s["median"] - s["q1"] for s in stats], [s["q3"] - s["median"] for s in stats]]
        x = list(range(len(methods)))
        ax.bar(x, med, yerr=err, capsize=4, color=[colours[m] for m in methods])
        for i, s in zip(x, stats, strict=True):
            ax.annotate(
                f"x{s['median']:.2f}",
                (i, s["q3"]),
                textcoords="offset points",
                xytext=(0, 4),
                ha="center",
                fontsize=9,
            )
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(row["target"], color=colours["guard"], ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_ylim(bottom, top * 2.5)
        ticks = [t for t in (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50) if bottom < t < top * 2.5]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xticks(x, [_TICKS[m] for m in methods], fontsize=9)
        plain_us = row["seconds"]["plain"]["median"] * 1e6
        ax.set_title(
            f"{label}: bare all_reduce {plain_us:.0f} µs\n"
            f"dashed: the guard's target, x{row['target']:g}",
            fontsize=10,
        )
        ax.tick_params(axis="y", labelsize=9)
    axes[0].set_ylabel("time per call / bare all_reduce", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str]) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m refimpl.bench guard", description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100, help="calls timed per sample")
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians of fewer are noise)")
    load_before = os.getloadavg()
    samples = spawn(measure, 2, args.repeats, args.calls, timeout_s=900)[0]
    result = {
        "benchmark": "per-all-reduce cost of CollectiveGuard and of DETAIL",
        "world_size": 2,
        "repeats": args.repeats,
        "calls_per_sample": args.calls,
        "method": "2 gloo ranks, one job; per repeat every method once per size, in an order "
        "that rotates each repeat; a sample is the slowest rank's seconds per call over "
        "calls_per_sample calls; ratios: per-repeat ratio to plain, median and quartiles",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "rows": summarise(samples),
    }
    path = write_json(args.out, "guard", result)
    import matplotlib.pyplot as plt

    fig = figure(result)
    fig.savefig(args.out / "guard.png", dpi=150)
    plt.close(fig)
    for label, row in result["rows"].items():
        r = row["over_plain"]
        print(
            f"{label}: all_reduce {row['seconds']['plain']['median'] * 1e6:.0f} µs | "
            + " | ".join(
                f"{LABELS[m]} x{r[m]['median']:.2f} [{r[m]['q1']:.2f}-{r[m]['q3']:.2f}]"
                for m in ("guard_off", "floor", "guard_gloo", "guard", "detail")
            )
            + f" | memcpy {row['seconds']['memcpy']['median'] * 1e6:.1f} µs"
        )
        print(f"  guard <= {row['target']:g}x: {'yes' if row['guard_meets_target'] else 'NO'}")
    print(f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"wrote {path} and {args.out / 'guard.png'}")
    return 0
