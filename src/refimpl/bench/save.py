"""``python -m refimpl.bench save --out DIR``: what a durable, atomic save costs.

Saves the same model-like state (``--mb`` MiB of float32 tensors) with each method, round
robin, ``--repeats`` times after one cold round, and reports medians with the spread:

- ``memcpy``: copy the tensors into pre-allocated buffers on one thread (the floor of any
  save; torch's copy on several threads waits for the slowest when another process holds a
  core, and the floor would move with the machine's load);
- ``write+fsync``: one ``os.write`` of the serialised byte count, then fsync (the disk floor);
- ``torch.save`` and ``torch.save+fsync``: what most trainers do, without and with fsync;
- ``atomic_save`` and ``atomic_save(durable=False)``: `refimpl.atomic`;
- ``save_checkpoint``: `refimpl.checkpoint` (atomic directory + xxh3-128 manifest).

Beside them: how fast a checkpoint verifies on load (`verify_checkpoint`, every byte read and
hashed), and the throughput of the digests it could use (sha256, xxh3-128) on the same bytes.
The goals the book states: ``atomic_save`` and ``save_checkpoint`` within 1.10x of
``torch.save+fsync``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from refimpl.atomic import DIGESTS, atomic_save
from refimpl.bench import summarize, write_json
from refimpl.checkpoint import save_checkpoint, verify_checkpoint

__all__ = ["main", "make_model_state", "methods"]


def make_model_state(mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``mb`` MiB of float32 in layer-sized tensors, like a model's state_dict."""
    gen = torch.Generator().manual_seed(seed)
    total = mb * (1 << 18)
    sizes = [total // 8] * 8  # eight "layers"
    return {f"layer{i}.weight": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def methods(state: dict[str, torch.Tensor], blob: bytes) -> dict[str, Callable[[Path], None]]:
    """Each method saves ``state`` (or, for the floors, moves its bytes) to a given path."""
    buffers = {k: torch.empty_like(v) for k, v in state.items()}

    def memcpy(path: Path) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # every other method here runs on one thread too
        try:
            for k, v in state.items():
                buffers[k].copy_(v)
        finally:
            torch.set_num_threads(threads)

    def write_fsync(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def torch_save(path: Path) -> None:
        torch.save(state, path)

    def torch_save_fsync(path: Path) -> None:
        torch.save(state, path)
        _fsync_path(path)

    def atomic(path: Path) -> None:
        atomic_save(state, path)

    def atomic_no_fsync(path: Path) -> None:
        atomic_save(state, path, durable=False)

    def checkpoint(path: Path) -> None:
        save_checkpoint(path, {"model": state}, 1, keep_last=None)

    return {
        "memcpy": memcpy,
        "write+fsync": write_fsync,
        "torch.save": torch_save,
        "torch.save+fsync": torch_save_fsync,
        "atomic_save(durable=False)": atomic_no_fsync,
        "atomic_save": atomic,
        "save_checkpoint": checkpoint,
    }


def _verify_and_hash_rates(
    state: dict[str, torch.Tensor], blob: bytes, scratch: Path, repeats: int
) -> dict[str, float]:
    """Bytes per second: verifying a saved checkpoint, and each digest over ``blob``."""
    step_dir = save_checkpoint(scratch / "verify", {"model": state}, 1, keep_last=None)
    rates: dict[str, float] = {}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        verify_checkpoint(step_dir)
        times.append(time.perf_counter() - start)
    rates["verify_checkpoint"] = len(blob) / summarize(times)["median"]
    for name, new in DIGESTS.items():
        start = time.perf_counter()
        new().update(blob)
        rates[name] = len(blob) / (time.perf_counter() - start)
    return rates


def _clean(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _plot(results: dict[str, Any], out: Path, title: str) -> Path:
    from matplotlib.figure import Figure  # no pyplot: no backend is chosen or changed

    names = list(results)
    med = [results[n]["median"] * 1e3 for n in names]
    lo = [m - results[n]["min"] * 1e3 for m, n in zip(med, names, strict=True)]
    hi = [results[n]["max"] * 1e3 - m for m, n in zip(med, names, strict=True)]
    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    ax.barh(names, med, xerr=[lo, hi], color="tab:blue", capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per save (median, min-max)")
    ax.set_title(title)
    fig.tight_layout()
    path = out / "save.png"
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str]) -> int:
    """Run the benchmark; write ``save.json`` and ``save.png`` to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m refimpl.bench save", description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mb", type=int, default=64, help="state size in MiB")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (>= 5)")
    parser.add_argument("--scratch", type=Path, default=None, help="where saves go")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--sizes-mb",
        type=int,
        nargs="+",
        default=None,
        help="the saving-overhead benchmark (chapter 9): every method incl. DCP sync/async, "
        "blocking and total time, at each of these state sizes",
    )
    args = parser.parse_args(argv)
    if args.sizes_mb:
        from refimpl.bench._save_report import run_overhead

        return run_overhead(args.sizes_mb, args.repeats, args.out, args.scratch, args.quiet)
    from tqdm.auto import tqdm

    state = make_model_state(args.mb)
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getvalue()
    todo = methods(state, blob)
    scratch = args.scratch or args.out / "_scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    samples: dict[str, list[float]] = {n: [] for n in todo}
    cold: dict[str, float] = {}
    try:
        with tqdm(total=(args.repeats + 1) * len(todo), disable=args.quiet, desc="save") as bar:
            for rnd in range(args.repeats + 1):
                for name, fn in todo.items():
                    path = scratch / f"save_{rnd}_{len(samples[name])}"
                    start = time.perf_counter()
                    fn(path)
                    elapsed = time.perf_counter() - start
                    _clean(path)
                    if rnd == 0:
                        cold[name] = elapsed  # first touch of files and allocator: reported apart
                    else:
                        samples[name].append(elapsed)
                    bar.update(1)
        rates = _verify_and_hash_rates(state, blob, scratch, args.repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = {n: {**summarize(s), "cold": cold[n]} for n, s in samples.items()}
    med = {n: r["median"] for n, r in results.items()}
    ratios = {
        "atomic_save / torch.save+fsync": med["atomic_save"] / med["torch.save+fsync"],
        "atomic_save(durable=False) / torch.save": med["atomic_save(durable=False)"]
        / med["torch.save"],
        "atomic_save / write+fsync": med["atomic_save"] / med["write+fsync"],
        "save_checkpoint / torch.save+fsync": med["save_checkpoint"] / med["torch.save+fsync"],
        "torch.save+fsync / write+fsync": med["torch.save+fsync"] / med["write+fsync"],
    }
    data = {
        "config": {"mb": args.mb, "bytes": len(blob), "repeats": args.repeats},
        "seconds": results,
        "ratios": ratios,
        "goal": {
            "atomic_save / torch.save+fsync <=": 1.10,
            "save_checkpoint / torch.save+fsync <=": 1.10,
        },
        "bytes_per_second": rates,
    }
    write_json(args.out, "save", data)
    png = _plot(results, args.out, f"saving {len(blob) / 2**20:.0f} MiB ({args.repeats} repeats)")
    for name, value in ratios.items():
        print(f"{name:>42}: {value:.2f}x")
    for name, rate in rates.items():
        print(f"{name + ' throughput':>42}: {rate / 1e9:.2f} GB/s")
    print(f"wrote {args.out / 'save.json'} and {png}")
    return 0
