"""``python -m refimpl.bench reshard --out DIR``: what loading at another world size costs.

An FSDP2 model of ``--size-mb`` of float32 parameters (``d x d`` linear layers) is saved
with `refimpl.sharded.save_sharded` at 2, 3 and 4 gloo ranks; then, at each world size W,
every one of those checkpoints is loaded with `refimpl.sharded.load_sharded`, one cold round
and ``--repeats`` timed rounds, and in each round twice: as refimpl reads now (each tensor
item's needed bytes only, `refimpl.sharded._ranges`; no second hash of a file rank 0 just
hashed on this machine, `refimpl.sharded._seen`) and as it read before (every file hashed
by every rank that reads it, each item through DCP's own per-item path), side by side.

The like-for-like comparison is at the same loading world size: a checkpoint saved at A != W
(DCP reshards: each rank reads the parts of other ranks' shards its rows overlap) against
the one saved at W (each rank reads its own). Each round gives one ratio of the two
throughputs, from loads made back to back (their order rotated every round); the JSON
reports the ratios' median and spread (min, max) for wall-clock time (the slowest rank's,
between barriers: the goal) and for CPU time (all ranks' together, which other processes on
a shared machine disturb less). Every load is checked against the saved weights. The files
sit in the page cache after the first round, so this measures planning, reading from
memory, digest checks and copying, not the disk. Writes ``reshard.json`` and ``reshard.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
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
from refimpl.sharded._read import VerifyingReader

WORLDS = (2, 3, 4)
GOAL = 0.8  # resharded load throughput / same-world-size load throughput
READERS = ("ranges", "dcp")  # refimpl now; as before (every file hashed, DCP per-item reads)


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


def _timed_load(source: str, model: nn.Module, ranged: bool) -> tuple[float, float]:
    """One load between barriers: (slowest rank's seconds, CPU seconds of all ranks)."""
    VerifyingReader.legacy_reads = not ranged
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    load_sharded(Path(source) / "step_00000001", model)
    took = torch.tensor([time.perf_counter() - start, time.process_time() - cpu])
    wall, cpu_s = took.clone(), took.clone()
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu_s, op=dist.ReduceOp.SUM)
    return float(wall[0]), float(cpu_s[1])


def load_job(sources: list[str], layers: int, d: int, repeats: int) -> dict[str, Any]:
    """Worker: load every checkpoint in ``sources`` with each reader, ``repeats + 1`` rounds.

    A round loads each (reader, source) once, a reader's loads back to back, the sources'
    order rotated and the readers' alternated every round; the first round is the cold one.
    Returns, per ``"reader source"``, the slowest rank's seconds of each timed round
    (``rounds_s``), the CPU seconds of all ranks (``cpu_s``), the cold load's seconds, and
    the weights' fingerprint after a last load."""
    model = build(layers, d, seed=1)  # other weights: a load that did nothing shows
    runs = [(reader, source) for reader in READERS for source in sources]
    wall: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    cpu: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    for round_ in range(repeats + 1):
        # the loads compared with each other (one reader's) run back to back, in an order
        # that rotates every round; the readers take turns going first
        shift = round_ % len(sources)
        order = sources[shift:] + sources[:shift]
        readers = READERS if round_ % 2 == 0 else READERS[::-1]
        for reader, source in [(r, s) for r in readers for s in order]:
            took, cpu_s = _timed_load(source, model, reader == "ranges")
            wall[reader, source].append(took)
            cpu[reader, source].append(cpu_s)
    out = {}
    for reader, source in runs:
        model = build(layers, d, seed=1)
        _timed_load(source, model, reader == "ranges")
        out[f"{reader} {source}"] = {
            "cold_s": wall[reader, source][0],
            "rounds_s": wall[reader, source][1:],
            "cpu_s": cpu[reader, source][1:],
            "fingerprint": _fingerprint(model),
        }
    VerifyingReader.legacy_reads = False
    return out


def _paired(same: list[float], other: list[float]) -> dict[str, float]:
    """Throughput ratio round by round (same-world time / resharded time), summarised."""
    return summarize([s / r for s, r in zip(same, other, strict=True)])


def draw(result: dict[str, Any], ax: Any, *, with_before: bool = True) -> None:
    """Each resharded pair's throughput ratio (median, min-max as a bar) on ``ax``, for
    refimpl's ranged reads and (``with_before``) for DCP's per-item path, with the goal as a
    line. Raises `KeyError` when ``result`` lacks a series it is asked to draw."""
    names = list(result["ratios"])
    now = "now: " if with_before else "refimpl: "
    series = [(f"{now}needed rows, no second hash", result["ratios"], "tab:blue")]
    if with_before:
        before = result["dcp_reader_ratios"]
        series.append(("before: whole chunks, all files hashed", before, "tab:gray"))
    width, step = (0.34, 0.36) if with_before else (0.6, 0.0)
    for i, (label, ratios, color) in enumerate(series):
        ys = [ratios[n]["median"] for n in names]
        err = [
            [y - ratios[n]["min"] for y, n in zip(ys, names, strict=True)],
            [ratios[n]["max"] - y for y, n in zip(ys, names, strict=True)],
        ]
        xs = [k + (i - (len(series) - 1) / 2) * step for k in range(len(names))]
        ax.bar(xs, ys, width, yerr=err, capsize=3, color=color, label=label)
    ax.axhline(GOAL, color="tab:red", linestyle="--", linewidth=1, label=f"goal {GOAL}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    short = [n.replace("saved at ", "").replace(", loaded at ", " @") for n in names]
    ax.set_xticks(range(len(names)), [s.replace(" / ", " vs ") for s in short], fontsize=9)
    ax.set_xlabel("saved at A vs saved at W, loaded at W ranks (@W)", fontsize=10)
    ax.set_ylabel("throughput ratio\n(resharded / same size)", fontsize=10)
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2)


def plot(result: dict[str, Any], path: Path) -> None:
    """`draw` into ``path`` (PNG)."""
    # The object API needs no backend: matplotlib.use("Agg") here would switch a notebook
    # that calls this off its inline backend for every later figure.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    draw(result, ax)
    ax.set_title(f"load_sharded of {result['size_mb']} MiB, resharded vs same world size")
    fig.tight_layout()
    fig.savefig(path, dpi=150, bbox_inches="tight")


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
    ratios: dict[str, dict[str, dict[str, float]]] = {"wall": {}, "cpu": {}}
    before: dict[str, dict[str, float]] = {}
    for w in WORLDS:
        print(f"loading each checkpoint at {w} ranks, {args.repeats + 1} rounds", flush=True)
        loaded = spawn(
            load_job, w, list(sources.values()), layers, args.d, args.repeats, timeout_s=900
        )[0]
        for reader in READERS:
            for saved, source in sources.items():
                got = loaded[f"{reader} {source}"]
                if not _same(got["fingerprint"], reference):
                    raise RuntimeError(
                        f"saved at {saved}, loaded at {w} ({reader}): weights differ"
                    )
                median = statistics.median(got["rounds_s"])
                rows.append(
                    {
                        "reader": reader,
                        "saved_at": saved,
                        "loaded_at": w,
                        "bytes": nbytes,
                        "cold_s": got["cold_s"],
                        "load_s": summarize(got["rounds_s"]),
                        "cpu_s": summarize(got["cpu_s"]),
                        "mb_per_s": (nbytes >> 20) / median,
                    }
                )
            same = loaded[f"{reader} {sources[w]}"]
            for saved in WORLDS:
                if saved == w:
                    continue
                other = loaded[f"{reader} {sources[saved]}"]
                name = f"saved at {saved} / saved at {w}, loaded at {w}"
                if reader == "ranges":
                    ratios["wall"][name] = _paired(same["rounds_s"], other["rounds_s"])
                    ratios["cpu"][name] = _paired(same["cpu_s"], other["cpu_s"])
                else:
                    before[name] = _paired(same["rounds_s"], other["rounds_s"])
    result = {
        "benchmark": "load_sharded throughput: resharded vs same world size",
        "size_mb": nbytes >> 20,
        "goal": f"every wall-clock ratio's median >= {GOAL}",
        "goal_met": all(v["median"] >= GOAL for v in ratios["wall"].values()),
        "weights_equal": True,  # every load above was checked against the saved fingerprint
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "note": "gloo ranks on one machine; files in the page cache",
        },
        "rows": rows,
        "ratios": ratios["wall"],
        "cpu_ratios": ratios["cpu"],
        "dcp_reader_ratios": before,
    }
    shutil.rmtree(work)  # three copies of the model
    write_json(args.out, "reshard", result)
    plot(result, args.out / "reshard.png")
    print(f"{'throughput ratio (median, min-max)':>40}  {'wall':<17} {'CPU':<17} DCP's reader")
    for name, r in ratios["wall"].items():
        c, b = ratios["cpu"][name], before[name]
        print(
            f"{name:>40}: "
            + "  ".join(f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})" for x in (r, c, b))
        )
    print(f"wrote {args.out / 'reshard.json'} and {args.out / 'reshard.png'}")
    return 0
