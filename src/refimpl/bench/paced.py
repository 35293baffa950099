"""``python -m refimpl.bench paced --out DIR``: does pacing the writer help ranks that wait?

Chapter 9's step-time table is measured in one process. This benchmark asks the question it
leaves open with ranks that wait for each other: ``--world-size`` gloo ranks train a small MLP
and all-reduce its gradients every step (as DDP does, so a step ends when the slowest rank's
step ends), while every rank's `refimpl.sharded.AsyncSaver` writes its part of a
``--mb`` MiB state in the background. Two savers per rank, used alternately, the order
rotating every round: ``AsyncSaver()`` (DCP's thread at the trainer's priority) and
``AsyncSaver(writer_cpu_share=PACED_SHARE)``. Before each save, six steps alone set the
baseline; the ranks keep stepping together until every rank's save has committed.

Per kind, over ``--rounds`` saves: the training time lost per save (the steps' excess over
the median step alone just before that save, summed, on rank 0, whose steps end with the
job's all-reduce), the median step during the save over a step alone, the slowest step, and
how long the save took to commit; each as the median with the spread (min, max) of the
rounds. ``--runs`` repeats all of it on freshly started ranks. Writes ``paced.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refimpl.bench import summarize, write_json
from refimpl.launch import spawn
from refimpl.sharded import AsyncSaver

__all__ = ["KINDS", "PACED_SHARE", "main", "measure"]

PACED_SHARE = 0.05
"""The share of one core the paced kind writes with (``AsyncSaver(writer_cpu_share=0.05)``, as
in chapter 9)."""
KINDS = {"thread": None, "paced": PACED_SHARE}
"""The kinds of background save measured, each with its ``writer_cpu_share`` (``None`` for
the unpaced one)."""


class _Job(torch.nn.Module):
    """The MLP that trains, beside the parameters only saved (no gradient: SGD skips them)."""

    def __init__(self, width: int, state_numel: int) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
        )
        self.state = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(state_numel // 8), requires_grad=False) for _ in range(8)
        )


def measure(scratch: str, mb: int, rounds: int, width: int = 512) -> dict[str, Any]:
    """Worker: per kind, lists over the rounds of lost seconds, step ratios, slowest steps
    and save durations (rank 0's clock; every rank's step ends with the same all-reduce)."""
    torch.set_num_threads(1)  # one core per rank: the ranks keep the machine's cores busy
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    # The state is replicated (a plain module), and DCP's planner spreads the writing of
    # replicated tensors over the ranks: each rank writes about mb / world MiB.
    job = _Job(width, mb * (1 << 18))
    params = [p for p in job.mlp.parameters()]
    opt = torch.optim.SGD(job.parameters(), lr=1e-3)
    x = torch.randn(64, width)
    flat = torch.zeros(sum(p.numel() for p in params) + 1)

    def step(saving: bool) -> tuple[float, bool]:
        """One step; returns its seconds and whether any rank's save is still in flight."""
        start = time.perf_counter()
        job.mlp(x).pow(2).mean().backward()
        torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None], out=flat[:-1])
        flat[-1] = float(saving)
        dist.all_reduce(flat)  # the step ends when every rank's gradients are in
        offset = 0
        for p in params:
            assert p.grad is not None
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p)).div_(world)
            offset += p.numel()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start, bool(flat[-1] > 0)

    savers = {kind: AsyncSaver(writer_cpu_share=share) for kind, share in KINDS.items()}
    kinds = list(KINDS)
    out: dict[str, dict[str, list[float]]] = {
        k: {"lost_s": [], "step_ratio": [], "slowest_step_s": [], "save_s": [], "steps": []}
        for k in kinds
    }
    alone_all: list[float] = []
    for _ in range(3):
        step(False)  # warm-up
    for r in range(-1, rounds):  # round -1: each saver's first (cold) save, not counted
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            before = [step(False)[0] for _ in range(6)]
            root = Path(scratch) / kind
            start = time.perf_counter()
            handle = savers[kind].save(root, job, opt, r + 2, keep_last=1)
            steps, busy = [], True
            while busy:
                took, busy = step(not handle.done())
                steps.append(took)
            handle.result()
            took_s = time.perf_counter() - start
            if r < 0:
                continue
            base = statistics.median(before)
            alone_all += before
            rec = out[kind]
            rec["lost_s"].append(sum(steps) - len(steps) * base)
            rec["step_ratio"].append(statistics.median(steps) / base)
            rec["slowest_step_s"].append(max(steps))
            rec["save_s"].append(took_s)
            rec["steps"].append(float(len(steps)))
    for saver in savers.values():
        saver.close()
    return {"alone_s": alone_all, "kinds": out}


def report(raw: dict[str, Any]) -> dict[str, Any]:
    """One run's summaries (median, min, max, n) of each measured list, per kind, and the
    ratio of the medians of lost seconds, paced over thread (NaN if the thread's is <= 0)."""
    kinds = {
        kind: {name: summarize(values) for name, values in rec.items()}
        for kind, rec in raw["kinds"].items()
    }
    lost = {kind: rec["lost_s"]["median"] for kind, rec in kinds.items()}
    return {
        "step_s_alone": summarize(raw["alone_s"]),
        "kinds": kinds,
        "lost_paced_over_thread": (
            lost["paced"] / lost["thread"] if lost["thread"] > 0 else float("nan")
        ),
        "raw": raw,
    }


def main(argv: list[str]) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m refimpl.bench paced")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mb", type=int, default=256, help="state saved, all ranks together")
    parser.add_argument("--rounds", type=int, default=9, help="saves of each kind per run")
    parser.add_argument("--runs", type=int, default=1, help="runs, each on fresh ranks")
    parser.add_argument("--width", type=int, default=512, help="the MLP's hidden width")
    args = parser.parse_args(argv)
    if args.rounds < 5:
        parser.error("--rounds must be at least 5 (medians of fewer are noise)")
    runs = []
    for _ in range(args.runs):
        load = os.getloadavg()[0]
        scratch = Path(tempfile.mkdtemp(prefix="bench-paced-"))
        try:
            raw = spawn(
                measure,
                args.world_size,
                str(scratch),
                args.mb,
                args.rounds,
                args.width,
                timeout_s=1800,
                pg_timeout_s=300,
            )[0]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        runs.append({"load_average_1min": [load, os.getloadavg()[0]], **report(raw)})
    result = {
        "world_size": args.world_size,
        "mb": args.mb,
        "rounds": args.rounds,
        "width": args.width,
        "paced_cpu_share": PACED_SHARE,
        "torch_threads_per_rank": 1,
        "cpu_count": os.cpu_count(),
        "runs": runs,
    }
    path = write_json(args.out, "paced", result)
    print(f"{args.world_size} ranks, {args.mb} MiB saved; per kind: median [min, max] of saves")
    for i, run in enumerate(runs):
        alone = run["step_s_alone"]["median"]
        print(f"run {i + 1}: step alone {alone * 1e3:.1f} ms")
        for kind, rec in run["kinds"].items():
            cells = []
            for name, unit in (("lost_s", "s"), ("step_ratio", "x"), ("save_s", "s")):
                s = rec[name]
                cells.append(f"{name} {s['median']:.2f}{unit} [{s['min']:.2f}, {s['max']:.2f}]")
            print(f"  {kind:<7} " + "  ".join(cells))
    print(f"wrote {path}")
    return 0
