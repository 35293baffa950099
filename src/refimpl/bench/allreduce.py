"""``python -m refimpl.bench allreduce --out DIR``: all-reduce time against message size.

Measures, side by side in one run on the same ranks: gloo's ``dist.all_reduce``, the
chapter's Python `refimpl.collectives.ring_all_reduce`, and the memcpy floor (copying the same
bytes into a pre-allocated buffer: no collective can move data faster than memory does).
Writes ``allreduce.json`` and ``allreduce.png``.
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
from tqdm import tqdm

from refimpl.bench import summarize, write_json
from refimpl.collectives import ring_all_reduce
from refimpl.launch import spawn

DEFAULT_SIZES = [2**k for k in range(4, 23, 3)]  # 16 .. 4M float32 elements


def _repeat(op: Callable[[], Any], repeats: int, sync: bool) -> list[float]:
    samples = []
    for _ in range(repeats):
        if sync:
            dist.barrier()
        start = time.perf_counter()
        op()
        samples.append(time.perf_counter() - start)
    return samples


def measure(sizes: list[int], repeats: int) -> dict[str, Any]:
    """Worker: timings (summaries, seconds) of each method at each element count."""
    rows = []
    show = dist.get_rank() == 0
    for numel in tqdm(sizes, desc="all-reduce sizes", disable=not show):
        tensor, dest = torch.ones(numel), torch.empty(numel)
        dist.all_reduce(tensor)  # warm-up
        ring_all_reduce(tensor)
        rows.append(
            {
                "numel": numel,
                "bytes": numel * 4,
                "gloo": summarize(_repeat(partial(dist.all_reduce, tensor), repeats, True)),
                "ring": summarize(_repeat(partial(ring_all_reduce, tensor), repeats, True)),
                # The floor is the fastest a copy can go: many cheap repeats, so that its min is
                # a copy nobody preempted even on a loaded machine.
                "memcpy": summarize(_repeat(partial(dest.copy_, tensor), max(repeats, 25), False)),
            }
        )
    return {"world_size": dist.get_world_size(), "repeats": repeats, "rows": rows}


def plot(result: dict[str, Any], path: Path) -> None:
    """Draw median time against message size for each method (log-log), with spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    nbytes = [r["bytes"] for r in result["rows"]]
    for key, label in (
        ("gloo", "dist.all_reduce (gloo)"),
        ("ring", "ring_all_reduce (Python)"),
        ("memcpy", "memcpy floor"),
    ):
        med = [r[key]["median"] * 1e3 for r in result["rows"]]
        lo = [r[key]["min"] * 1e3 for r in result["rows"]]
        hi = [r[key]["max"] * 1e3 for r in result["rows"]]
        ax.plot(nbytes, med, marker="o", label=label)
        ax.fill_between(nbytes, lo, hi, alpha=0.2)
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="time (ms)")
    ax.set_title(f"all-reduce on {result['world_size']} gloo ranks (median, min-max band)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m refimpl.bench allreduce")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians of fewer are noise)")
    result = spawn(
        measure, args.world_size, DEFAULT_SIZES, args.repeats, timeout_s=600, rank_output="inherit"
    )[0]
    for row in result["rows"]:
        row["ring_over_gloo"] = row["ring"]["median"] / row["gloo"]["median"]
        row["gloo_over_memcpy"] = row["gloo"]["median"] / row["memcpy"]["median"]
    path = write_json(args.out, "allreduce", result)
    plot(result, args.out / "allreduce.png")
    for row in result["rows"]:
        print(
            f"{row['bytes']:>10} B  ring/gloo {row['ring_over_gloo']:6.2f}x  "
            f"gloo/memcpy {row['gloo_over_memcpy']:8.1f}x"
        )
    print(f"wrote {path} and {args.out / 'allreduce.png'}")
    return 0
