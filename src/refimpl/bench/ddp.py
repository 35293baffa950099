"""``python -m refimpl.bench ddp --out DIR``: step time of naive / MiniDDP / torch DDP.

Two gloo ranks train the same MLP (over 10M parameters by default) with five data-parallel
versions, for every ``bucket_cap_mb``:

- ``naive``: `NaiveDDP`, one blocking all-reduce per parameter after backward;
- ``mini``: `MiniDDP` with that cap (its ``.grad`` is a view of the bucket, set by each hook);
- ``mini_late``: `refimpl.demos.ddp_profile.LateViewMiniDDP`, MiniDDP before the profile of
  chapter 3: ``.grad`` becomes the bucket's view only at the end of backward, so every fresh
  gradient stays alive until then (the before of the before/after);
- ``ddp_view``: ``DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=True)``, the
  like-for-like comparison for MiniDDP (same partition: an explicit cap is also the first
  bucket's; gradients are bucket views);
- ``ddp_default``: ``DDP(model)``, PyTorch's true default (25 MB with a 1 MB first bucket,
  gradients copied back from the bucket); it does not depend on the cap and is measured in
  every run as a reference.

Repeats are interleaved (the order of the versions rotates every repeat) so that load from
other processes on a shared machine hits all of them alike; each repeat times a few steps
(forward, backward, SGD step) after a barrier and keeps the slowest rank's time, and also
records the CPU time of the training thread and the minor page faults per step. Ratios are
paired: within each repeat the versions ran back to back, so each repeat gives one ratio and
the JSON reports the median ratio (and its quartiles) besides the ratio of medians. The PNG
plots those paired ratios (each version over ``ddp_view``) with their quartiles. Last, at
``--profile-cap``, `refimpl.demos.ddp_profile.profile_step` profiles a step of MiniDDP
(before and after) and of DDP: CPU time, page faults, the tail after the last gradient and
the Python in MiniDDP's hooks (JSON key ``profile``).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
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
from refimpl.demos.ddp_profile import LateViewMiniDDP, profile_step
from refimpl.launch import spawn

IMPLS = ("naive", "mini_late", "mini", "ddp_view", "ddp_default")
RATIOS = {  # name: (numerator, denominator)
    "mini/ddp_view": ("mini", "ddp_view"),
    "mini_late/ddp_view": ("mini_late", "ddp_view"),
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
    if impl == "mini_late":
        return LateViewMiniDDP(model, bucket_cap_mb=cap)
    if impl == "ddp_view":
        return DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=True)
    return DDP(model)  # ddp_default: no bucket_cap_mb, so 25 MB with a 1 MB first bucket


def step_times(
    cap: float, widths: tuple[int, ...], batch: int, repeats: int, steps: int
) -> dict[str, dict[str, list[float]]]:
    """Worker: per implementation at this bucket size, per repeat: seconds per training step
    (``wall``), CPU seconds of the training thread per step (``cpu``) and minor page faults
    per step (``faults``), each the largest over the ranks."""
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
    samples: dict[str, dict[str, list[float]]] = {
        impl: {"wall": [], "cpu": [], "faults": []} for impl in IMPLS
    }
    for r in range(repeats):
        # Rotate who goes first, so no version always runs right after the same neighbour.
        k = r % len(IMPLS)
        for impl in IMPLS[k:] + IMPLS[:k]:
            dist.barrier()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start, cpu = time.perf_counter(), time.thread_time()
            run(impl, steps)
            sample = (
                torch.tensor(
                    [
                        time.perf_counter() - start,
                        time.thread_time() - cpu,
                        resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                    ],
                    dtype=torch.float64,
                )
                / steps
            )
            dist.all_reduce(sample, op=dist.ReduceOp.MAX)  # a step lasts for the slowest rank
            for key, value in zip(("wall", "cpu", "faults"), sample.tolist(), strict=True):
                samples[impl][key].append(value)
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


LABELS = {  # ratio: how the figure names it
    "naive/ddp_view": "naive: one all-reduce per parameter, after backward",
    "mini_late/ddp_view": "MiniDDP before (.grad set at the end of backward)",
    "mini/ddp_view": "MiniDDP",
    "ddp_default/ddp_view": "DDP(): 25 MB, 1 MB first, averages copied back",
}


def draw(data: dict[str, Any], ax: Any) -> Any:
    """Each version's step time over DDP(bucket_cap_mb=cap, gradient_as_bucket_view=True)'s,
    against bucket_cap_mb: the median of the paired per-repeat ratios, bars from the first to
    the third quartile (points shifted sideways a little so the bars do not overlap)."""
    caps = sorted(float(c) for c in data["ratios"])
    for k, (name, label) in enumerate(LABELS.items()):
        shift = 1.06 ** (k - (len(LABELS) - 1) / 2)
        r = [data["ratios"][str(c)][name] for c in caps]
        med = [x["median"] for x in r]
        err = [[x["median"] - x["q1"] for x in r], [x["q3"] - x["median"] for x in r]]
        style = "--" if name.startswith("ddp_default") else "-"
        ax.errorbar(
            [c * shift for c in caps], med, yerr=err, marker="o", capsize=3, ls=style, label=label
        )
    ax.axhline(1.0, color="black", lw=1, ls=":", label="1 = DDP(view): same buckets, .grad views")
    ax.set_xscale("log")
    ax.set_xticks(caps, [f"{c:g}" for c in caps])
    ax.minorticks_off()
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("step time / DDP(view)'s")
    m = data["model"]
    ax.set_title(f"2 gloo ranks, {m['parameters'] / 1e6:.1f}M-parameter MLP, batch {m['batch']}")
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    return ax


def plot(data: dict[str, Any], path: Path) -> None:
    """Write `draw`'s figure to ``path`` (PNG)."""
    # The object API needs no backend: matplotlib.use("Agg") here would switch a notebook
    # that calls this off its inline backend for every later figure.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    draw(data, ax)
    fig.tight_layout()
    fig.savefig(path, dpi=150)


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
    ap.add_argument("--profile-cap", type=float, default=25.0)
    ap.add_argument(
        "--profile-repeats", type=int, default=15, help="repeats of the profile (0: skip it)"
    )
    args = ap.parse_args(argv)
    widths = (args.width,) * (args.depth + 1)
    n_params = sum(p.numel() for p in make_mlp(widths).parameters())
    load_at_start = os.getloadavg()
    results: dict[str, Any] = {}
    for cap in tqdm(args.caps, desc="bucket_cap_mb", unit="cap"):
        samples = spawn(
            step_times, 2, cap, widths, args.batch, args.repeats, args.steps, timeout_s=900
        )[0]
        results[str(cap)] = {
            impl: summarize(s["wall"])
            | {"samples": s["wall"], "cpu": summarize(s["cpu"]), "faults": summarize(s["faults"])}
            for impl, s in samples.items()
        }
    ratios = {cap: paired_ratios(r) for cap, r in results.items()}
    profile = {}
    if args.profile_repeats > 0:
        profile = spawn(
            profile_step,
            2,
            widths,
            args.batch,
            args.profile_cap,
            args.profile_repeats,
            args.steps,
            timeout_s=900,
        )[0]
    data = {
        "benchmark": "ddp step time: naive vs MiniDDP vs torch DDP",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "shared": "yes: other jobs ran on the same 2 cores; compare ratios, not times",
            "loadavg_at_start": load_at_start,
            "loadavg_at_end": os.getloadavg(),
        },
        "model": {"widths": list(widths), "parameters": n_params, "batch": args.batch},
        "method": f"2 gloo ranks; {args.repeats} interleaved repeats of {args.steps} steps; "
        "per repeat the slowest rank's seconds per step; ratios: median over repeats of the "
        "per-repeat ratio",
        "results": results,
        "ratios": ratios,
        "profile": {"bucket_cap_mb": args.profile_cap, "ms_per_step": profile},
    }
    path = write_json(args.out, "bench_ddp", data)
    plot(data, args.out / "bench_ddp.png")
    for cap, r in ratios.items():
        print(f"cap {cap:>6} MB: " + "  ".join(f"{k} {v['median']:.2f}" for k, v in r.items()))
    for version, row in profile.items():
        print(f"{version:>15}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()))
    print(f"wrote {path} and {args.out / 'bench_ddp.png'}")
    return 0
