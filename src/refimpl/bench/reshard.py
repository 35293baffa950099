"""``python -m refimpl.bench reshard --out DIR``: what loading at another world size costs.

An FSDP2 model of ``--size-mb`` of float32 parameters (``d x d`` linear layers) is saved
with `refimpl.sharded.save_sharded` at 2, 3 and 4 gloo ranks; then, at each world size W,
every one of those checkpoints is loaded with `refimpl.sharded.load_sharded`, round robin,
one cold round and ``--repeats`` timed rounds. The like-for-like comparison is at the same
loading world size: a checkpoint saved at A != W (DCP reshards: each rank reads the parts of
other ranks' shards its rows overlap) against the one saved at W (each rank reads its own).
Time is the slowest rank's, between barriers; every load is checked against the saved
weights. The files sit in the page cache after the first round, so this measures planning,
reading from memory, digest checks and copying, not the disk. Writes ``reshard.json`` and
``reshard.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from refimpl.bench import summarize, write_json
from refimpl.demos.sharded import shard
from refimpl.launch import spawn
from refimpl.sharded import load_sharded, save_sharded

WORLDS = (2, 3, 4)
GOAL = 0.8  # resharded load throughput / same-world-size load throughput


def build(layers: int, d: int, seed: int) -> nn.Sequential:
    """``layers`` bias-free ``d x d`` linear layers, initialised from ``seed``, then sharded."""
    torch.manual_seed(seed)
    return shard(nn.Sequential(*(nn.Linear(d, d, bias=False) for _ in range(layers))))


def _fingerprint(model: nn.Module) -> list[float]:
    """Per-layer sums of the full weights (collective: every rank gets the same list)."""
    local = torch.stack([cast(Any, p).to_local().double().sum() for p in model.parameters()])
    dist.all_reduce(local)
    return [float(x) for x in local]


def _same(a: list[float], b: list[float] | None) -> bool:
    """Equal weights: per-layer sums agree (summed in another order at another world size)."""
    return b is not None and all(
        math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b, strict=True)
    )


def save_job(directory: str, layers: int, d: int) -> list[float]:
    """Worker: save the seed-0 model once, as step 1 of ``directory``."""
    model = build(layers, d, seed=0)
    save_sharded(directory, model, torch.optim.SGD(model.parameters(), lr=0.0), 1)
    return _fingerprint(model)


def load_job(sources: list[str], layers: int, d: int, repeats: int) -> dict[str, Any]:
    """Worker: load every checkpoint in ``sources`` ``repeats + 1`` times, round robin.

    Returns, per source, the slowest rank's seconds per timed load, the cold load's, and
    the weights' fingerprint after the last load.
    """
    model = build(layers, d, seed=1)  # other weights: a load that did nothing shows
    times: dict[str, list[float]] = {s: [] for s in sources}
    for _ in range(repeats + 1):
        for source in sources:
            dist.barrier()
            start = time.perf_counter()
            load_sharded(Path(source) / "step_00000001", model)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[source].append(float(elapsed))
    out = {}
    for source in sources:
        load_sharded(Path(source) / "step_00000001", model)
        out[source] = {
            "cold_s": times[source][0],
            "load_s": summarize(times[source][1:]),
            "fingerprint": _fingerprint(model),
        }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput of each load, grouped by the world size that loads it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(WORLDS)
    for i, saved in enumerate(WORLDS):
        rows = [r for r in result["rows"] if r["saved_at"] == saved]
        xs = [WORLDS.index(r["loaded_at"]) + (i - 1) * width for r in rows]
        ax.bar(xs, [r["mb_per_s"] for r in rows], width, label=f"saved at {saved} ranks")
    ax.set_xticks(range(len(WORLDS)), [f"loaded at {w} ranks" for w in WORLDS])
    ax.set_ylabel("MiB/s (median, slowest rank)")
    ax.set_title(f"load_sharded of {result['size_mb']} MiB: same world size vs resharded")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m refimpl.bench reshard")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size-mb", type=int, default=256, help="float32 parameter MiB")
    parser.add_argument("--d", type=int, default=1024, help="rows and columns per layer")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians of fewer are noise)")
    layers = max(1, (args.size_mb << 20) // (4 * args.d * args.d))
    nbytes = layers * args.d * args.d * 4
    work = args.out / "reshard-ckpts"
    sources = {w: str(work / f"saved_at_{w}") for w in WORLDS}
    reference = None
    for w in WORLDS:
        print(f"saving {nbytes >> 20} MiB at {w} ranks", flush=True)
        fingerprint = spawn(save_job, w, sources[w], layers, args.d, timeout_s=600)[0]
        if reference is not None and not _same(fingerprint, reference):
            raise RuntimeError(f"the model saved at {w} ranks differs from the one at 2")
        reference = fingerprint
    rows = []
    for w in WORLDS:
        print(f"loading each checkpoint at {w} ranks, {args.repeats + 1} rounds", flush=True)
        loaded = spawn(load_job, w, list(sources.values()), layers, args.d, args.repeats,
                       timeout_s=600)[0]  # fmt: skip
        for saved, source in sources.items():
            got = loaded[source]
            if not _same(got["fingerprint"], reference):
                raise RuntimeError(f"saved at {saved}, loaded at {w}: the weights differ")
            median = got["load_s"]["median"]
            rows.append({"saved_at": saved, "loaded_at": w, "bytes": nbytes,
                         "cold_s": got["cold_s"], "load_s": got["load_s"],
                         "mb_per_s": (nbytes >> 20) / median})  # fmt: skip
    by = {(r["saved_at"], r["loaded_at"]): r["mb_per_s"] for r in rows}
    ratios = {f"saved at {a} / saved at {w}, loaded at {w}": by[(a, w)] / by[(w, w)]
              for w in WORLDS for a in WORLDS if a != w}  # fmt: skip
    result = {
        "benchmark": "load_sharded throughput: resharded vs same world size",
        "size_mb": nbytes >> 20,
        "goal": f"every ratio >= {GOAL}",
        "goal_met": all(v >= GOAL for v in ratios.values()),
        "weights_equal": True,  # every load above was checked against the saved fingerprint
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "note": "gloo ranks on one machine; files in the page cache",
        },
        "rows": rows,
        "ratios": ratios,
    }
    shutil.rmtree(work)  # three copies of the model
    write_json(args.out, "reshard", result)
    plot(result, args.out / "reshard.png")
    for name, value in ratios.items():
        print(f"{name:>40}: {value:.2f}")
    print(f"wrote {args.out / 'reshard.json'} and {args.out / 'reshard.png'}")
    return 0
