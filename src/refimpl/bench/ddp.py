"""``python -m refimpl.bench ddp --out DIR``: step time of naive / MiniDDP / torch DDP.

Two gloo ranks train the same MLP (over 10M parameters by default) with four data-parallel
versions, for every ``bucket_cap_mb``:

- ``naive``: `NaiveDDP`, one blocking all-reduce per parameter after backward;
- ``mini``: `MiniDDP` with that cap (its ``.grad`` is a view of the bucket);
- ``ddp_view``: ``DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=True)``, the
  like-for-like comparison for MiniDDP (same partition: an explicit cap is also the first
  bucket's; gradients are bucket views);
- ``ddp_default``: ``DDP(model)``, PyTorch's true default (25 MB with a 1 MB first bucket,
  gradients copied back from the bucket); it does not depend on the cap and is measured in
  every run as a reference.

Repeats are interleaved (the order of the versions rotates every repeat) so that load from
other processes on a shared machine hits all of them alike; each repeat times a few steps
(forward, backward, SGD step) after a barrier and keeps the slowest rank's time. Ratios are
paired: within each repeat the versions ran back to back, so each repeat gives one ratio and
the JSON reports the median ratio (and its quartiles) besides the ratio of medians. The PNG
plots median step times with their min-max range.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.bench import summarize, write_json
from refimpl.ddp import MiniDDP, NaiveDDP
from refimpl.demos.ddp import make_mlp
from refimpl.launch import spawn

IMPLS = ("naive", "mini", "ddp_view", "ddp_default")
RATIOS = {  # name: (numerator, denominator)
    "mini/ddp_view": ("mini", "ddp_view"),
    "naive/ddp_view": ("naive", "ddp_view"),
    "ddp_default/ddp_view": ("ddp_default", "ddp_view"),
    "mini/ddp_default": ("mini", "ddp_default"),
}
CAPS = (0.5, 1.0, 5.0, 25.0, 100.0)


def _wrap(impl: str, widths: tuple[int, ...], cap: float) -> torch.nn.Module:
    model = make_mlp(widths, seed=0)
    if impl == "naive":
        return NaiveDDP(model)
    if impl == "mini":
        return MiniDDP(model, bucket_cap_mb=cap)
    if impl == "ddp_view":
        return DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=True)
    return DDP(model)  # ddp_default: no bucket_cap_mb, so 25 MB with a 1 MB first bucket


def step_times(
    cap: float, widths: tuple[int, ...], batch: int, repeats: int, steps: int
) -> dict[str, list[float]]:
    """Worker: seconds per training step for each implementation at this bucket size."""
    models = {impl: _wrap(impl, widths, cap) for impl in IMPLS}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(dist.get_rank()))

    def run(impl: str, n: int) -> None:
        for _ in range(n):
            models[impl](x).pow(2).mean().backward()
            opts[impl].step()
            opts[impl].zero_grad()

    for impl in IMPLS:  # warm-up: allocation, and torch DDP's bucket rebuild after step 1
        run(impl, 2)
    samples: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for r in range(repeats):
        # Rotate who goes first, so no version always runs right after the same neighbour.
        k = r % len(IMPLS)
        for impl in IMPLS[k:] + IMPLS[:k]:
            dist.barrier()
            start = time.perf_counter()
            run(impl, steps)
            elapsed = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts for the slowest rank
            samples[impl].append(float(elapsed))
    return samples


def paired_ratios(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per ratio: the median (and quartiles) of the per-repeat ratios, and the ratio of the
    medians. Paired ratios cancel load that hit one whole repeat."""
    out = {}
    for name, (num, den) in RATIOS.items():
        per_repeat = sorted(
            a / b for a, b in zip(result[num]["samples"], result[den]["samples"], strict=True)
        )
        q = statistics.quantiles(per_repeat, n=4) if len(per_repeat) > 1 else per_repeat * 3
        out[name] = {
            "median": statistics.median(per_repeat),
            "q1": q[0],
            "q3": q[-1],
            "ratio_of_medians": result[num]["median"] / result[den]["median"],
        }
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    """Median step time (with min–max bars) against bucket_cap_mb, one line per version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [float(c) for c in data["results"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {
        "naive": "naive (all-reduce after backward)",
        "mini": "MiniDDP",
        "ddp_view": "DDP(bucket_cap_mb=cap, gradient_as_bucket_view=True)",
        "ddp_default": "DDP() default: 25 MB, 1 MB first, copy back",
    }
    for impl in IMPLS:
        stats = [data["results"][str(c)][impl] for c in caps]
        med = [1e3 * s["median"] for s in stats]
        err = [
            [1e3 * (s["median"] - s["min"]) for s in stats],
            [1e3 * (s["max"] - s["median"]) for s in stats],
        ]
        style = "--" if impl == "ddp_default" else "-"
        ax.errorbar(caps, med, yerr=err, marker="o", capsize=3, label=labels[impl], ls=style)
    ax.set_xscale("log")
    ax.set_xticks(caps, [f"{c:g}" for c in caps])
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("step time (ms), median, min–max")
    m = data["model"]
    ax.set_title(f"2 gloo ranks, {m['parameters'] / 1e6:.1f}M-parameter MLP, batch {m['batch']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Run the benchmark and write ``bench_ddp.json`` and ``bench_ddp.png`` into ``--out``."""
    from tqdm import tqdm

    ap = argparse.ArgumentParser(prog="python -m refimpl.bench ddp", description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--steps", type=int, default=2, help="steps timed per repeat")
    ap.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--depth", type=int, default=20, help="number of Linear layers")
    ap.add_argument("--caps", type=float, nargs="+", default=list(CAPS))
    args = ap.parse_args(argv)
    widths = (args.width,) * (args.depth + 1)
    n_params = sum(p.numel() for p in make_mlp(widths).parameters())
    results: dict[str, Any] = {}
    for cap in tqdm(args.caps, desc="bucket_cap_mb", unit="cap"):
        samples = spawn(
            step_times, 2, cap, widths, args.batch, args.repeats, args.steps, timeout_s=600
        )[0]
        results[str(cap)] = {impl: summarize(s) | {"samples": s} for impl, s in samples.items()}
    ratios = {cap: paired_ratios(r) for cap, r in results.items()}
    data = {
        "benchmark": "ddp step time: naive vs MiniDDP vs torch DDP",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "shared": "yes: other jobs ran on the same 2 cores; compare ratios, not times",
            "loadavg_at_end": os.getloadavg(),
        },
        "model": {"widths": list(widths), "parameters": n_params, "batch": args.batch},
        "method": f"2 gloo ranks; {args.repeats} interleaved repeats of {args.steps} steps; "
        "per repeat the slowest rank's seconds per step; ratios: median over repeats of the "
        "per-repeat ratio",
        "results": results,
        "ratios": ratios,
    }
    path = write_json(args.out, "bench_ddp", data)
    plot(data, args.out / "bench_ddp.png")
    for cap, r in ratios.items():
        print(f"cap {cap:>6} MB: " + "  ".join(f"{k} {v['median']:.2f}" for k, v in r.items()))
    print(f"wrote {path} and {args.out / 'bench_ddp.png'}")
    return 0
