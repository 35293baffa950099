"""Chapter 7's demos: a multi-dataset, multi-task loop that hangs, its quiet twin, and the fix.

Three small synthetic datasets carry different tasks (``seg`` has an extra one, as real
multi-task corpora do). Each step a rank draws one dataset, computes a (sum, count) per task
of that dataset and all-reduces it, one collective per task metric, the way a per-metric
``update()`` followed by a sync does. Every worker catches what goes wrong and returns it with
its call log, so the chapter can show each rank's view; a short process-group timeout ends
every hang in seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from refimpl.demos.desync import dump_flight_recorder
from refimpl.guard import CollectiveGuard, CollectiveMismatch
from refimpl.metrics import sync_metrics
from refimpl.mixture import MixtureSampler

TASKS: dict[str, tuple[str, ...]] = {
    "cls": ("loss", "acc"),
    "det": ("loss", "map"),
    "seg": ("loss", "iou", "boundary"),  # one task more than the others
}
SIZES = {"cls": 96, "det": 64, "seg": 48}
BATCH = 4


def metric_value(
    dataset: str, task: str, index: int, tasks: dict[str, tuple[str, ...]] | None = None
) -> float:
    """The synthetic per-sample metric: fixed by (dataset, task, sample), known to every rank.
    ``tasks``: the datasets' tasks, if not `TASKS`."""
    tasks = TASKS if tasks is None else tasks
    d = sorted(tasks).index(dataset)
    t = tasks[dataset].index(task)
    return ((index * 7919 + d * 104729 + t * 1299709) % 1000) / 1000


def _naive_choice(rank: int, seed: int) -> random.Random:
    # The bug: each rank's dataset choice comes from an RNG seeded per rank (or not at all).
    return random.Random(seed * 100 + rank)


def _one_step(
    dataset: str, indices: list[int], tasks: dict[str, tuple[str, ...]] | None = None
) -> list[tuple[str, float, int]]:
    tasks = TASKS if tasks is None else tasks
    return [
        (
            f"{dataset}/{task}",
            sum(metric_value(dataset, task, i, tasks) for i in indices),
            len(indices),
        )
        for task in tasks[dataset]
    ]


def naive_draws(rank: int, steps: int, datasets: tuple[str, ...], seed: int = 3) -> list[str]:
    """The datasets ``multitask_loop(fixed=False)`` draws on ``rank``, without running it."""
    rng = _naive_choice(rank, seed)
    return [rng.choice(sorted(datasets)) for _ in range(steps)]


def multitask_loop(
    steps: int,
    *,
    datasets: tuple[str, ...] = ("cls", "det", "seg"),
    fixed: bool = False,
    guard: bool = False,
    barrier_at_end: str = "barrier",
    seed: int = 3,
    flight_recorder: str | None = None,
    tasks: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, Any]:
    """Worker: ``steps`` training steps; returns this rank's call log, synced values, error.

    ``fixed=False`` draws each rank's dataset from its own RNG (the bug); ``fixed=True`` uses
    `MixtureSampler` (same dataset on every rank). ``guard=True`` routes every all-reduce through
    `CollectiveGuard`. After the loop every rank waits at ``barrier_at_end`` (``"barrier"``,
    ``"monitored"`` for ``dist.monitored_barrier``, or ``"none"``). ``flight_recorder``: a
    folder to write this rank's flight-recorder buffer into at the end (`dump_flight_recorder`).
    ``tasks``: each dataset's tasks, if not `TASKS`.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = {name: SIZES[name] for name in datasets}
    g = CollectiveGuard(timeout_s=3.0) if guard else None
    rng = _naive_choice(rank, seed)
    sampler = MixtureSampler(sizes, batch_size=BATCH, rank=rank, world_size=world, seed=seed)
    draws = iter(sampler)
    calls: list[dict[str, Any]] = []
    synced: dict[str, list[float]] = {}
    error = None
    start = time.monotonic()
    try:
        for step in range(steps):
            if fixed:
                dataset, indices = next(draws)
            else:
                dataset = rng.choice(sorted(sizes))
                first = (step * world + rank) * BATCH % sizes[dataset]
                indices = [(first + k) % sizes[dataset] for k in range(BATCH)]
            for name, total, count in _one_step(dataset, indices, tasks):
                calls.append({"step": step, "name": name, "sum": total, "count": count})
                t = torch.tensor([total, float(count)], dtype=torch.float64)
                if g is not None:
                    g.all_reduce(t, name=name)
                else:
                    dist.all_reduce(t)
                acc = synced.setdefault(name, [0.0, 0.0])
                acc[0] += t[0].item()
                acc[1] += t[1].item()
        if barrier_at_end == "barrier":
            dist.barrier()
        elif barrier_at_end == "monitored":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=3))
    except CollectiveMismatch as exc:
        error = f"CollectiveMismatch: {exc}"
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {_first_line(exc)}"
    if flight_recorder is not None:
        dump_flight_recorder(flight_recorder)
    return {
        "rank": rank,
        "calls": calls,
        "synced": synced,
        "error": error,
        "seconds": round(time.monotonic() - start, 1),
    }


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    return text.split("] ", 1)[-1] if text.startswith("[") else text


def true_means(results: list[dict[str, Any]]) -> dict[str, float]:
    """What each metric's global mean should be, from every rank's own contributions."""
    totals: dict[str, list[float]] = {}
    for res in results:
        for call in res["calls"]:
            acc = totals.setdefault(call["name"], [0.0, 0.0])
            acc[0] += call["sum"]
            acc[1] += call["count"]
    return {name: s / c for name, (s, c) in sorted(totals.items())}


def epoch_metrics(steps: int, *, fixed: bool, seed: int = 3) -> dict[str, Any]:
    """Worker: accumulate metrics locally for ``steps`` steps, then one `sync_metrics` call.

    With per-rank dataset choice (``fixed=False``) ranks hold different key sets; the sync
    still agrees. Returns the local contributions and the synced totals."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = _naive_choice(rank, seed)
    sampler = iter(MixtureSampler(SIZES, batch_size=BATCH, rank=rank, world_size=world, seed=seed))
    local: dict[str, tuple[float, int]] = {}
    calls = []
    for step in range(steps):
        if fixed:
            dataset, indices = next(sampler)
        else:
            dataset = rng.choice(sorted(SIZES))
            first = (step * world + rank) * BATCH % SIZES[dataset]
            indices = [(first + k) % SIZES[dataset] for k in range(BATCH)]
        for name, total, count in _one_step(dataset, indices):
            s, c = local.get(name, (0.0, 0))
            local[name] = (s + total, c + count)
            calls.append({"step": step, "name": name, "sum": total, "count": count})
    totals = sync_metrics(local)
    return {
        "rank": rank,
        "keys": sorted(local),
        "calls": calls,
        "totals": {k: (v.sum, v.count) for k, v in totals.items()},
    }


def gather_object_meets_all_gather() -> str:
    """Worker: rank 0 calls ``all_gather_object``; the others, one step behind, an all_gather of
    a float64 metric. Returns what each rank got (rank 0: the allocation error)."""
    try:
        if dist.get_rank() == 0:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, {"acc": 0.5})
            return f"rank 0 got {out}"
        parts = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, torch.tensor([1e30], dtype=torch.float64))
        return f"rank {dist.get_rank()} got {[p.item() for p in parts]}"
    except RuntimeError as exc:
        return f"rank {dist.get_rank()}: RuntimeError: {_first_line(exc)}"


@contextlib.contextmanager
def environment(**variables: str) -> Iterator[None]:
    """Set environment variables for the ranks `spawn` starts inside the block (restored after)."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def call_table(results: list[dict[str, Any]], first: int = 8) -> str:
    """Each rank's first ``first`` collectives side by side, ``!`` where the names differ."""
    rows = []
    for i in range(first):
        names = [r["calls"][i]["name"] if i < len(r["calls"]) else "-" for r in results]
        mark = "  " if len(set(names)) == 1 else "! "
        rows.append(mark + f"#{i:<3}" + "".join(f"{n:<16}" for n in names))
    header = "    " + "    " + "".join(f"rank {r['rank']:<11}" for r in results)
    return "\n".join([header, *rows])


def plot_call_sequences(
    before: list[dict[str, Any]], after: list[dict[str, Any]], first: int = 10
) -> Any:
    """Two panels, one row per rank, one box per collective coloured by dataset and labelled
    with the task: per-rank dataset choice (calls pair unrelated metrics) and the fix."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colours = {"cls": "#4C72B0", "det": "#55A868", "seg": "#C44E52"}
    fig, axes = plt.subplots(2, 1, figsize=(8, 4.2), sharex=True)
    for ax, results, title in (
        (axes[0], before, "each rank picks its own dataset: call #i pairs different metrics"),
        (axes[1], after, "MixtureSampler: the same dataset on every rank, calls pair up"),
    ):
        for res in results:
            y = res["rank"]
            for i, call in enumerate(res["calls"][:first]):
                dataset, task = call["name"].split("/")
                others = {r["calls"][i]["name"] for r in results if i < len(r["calls"])}
                edge = "black" if len(others) > 1 else "white"
                ax.add_patch(
                    Rectangle((i, y - 0.4), 0.95, 0.8, color=colours[dataset], ec=edge, lw=2)
                )
                ax.text(i + 0.47, y, task, ha="center", va="center", fontsize=9, color="white")
        ax.set_ylim(len(results) - 0.5, -0.5)
        ax.set_yticks(range(len(results)), [f"rank {r['rank']}" for r in results], fontsize=10)
        ax.set_title(title, fontsize=10, loc="left")
    axes[1].set_xlim(0, first)
    axes[1].set_xticks([i + 0.47 for i in range(first)], [f"#{i}" for i in range(first)])
    axes[1].tick_params(axis="x", labelsize=10, length=0)
    axes[1].set_xlabel("collective call (black edge: the ranks disagree on what it reduces)")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, list(colours), loc="lower center", ncol=3, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def skip_a_guarded_call(skip: str, timeout_s: float = 1.0) -> str:
    """Worker: every rank makes three guarded all-reduces, ``val/loss``, ``val/acc``,
    ``val/f1``, except that the last rank skips the one named ``skip``. Returns the error
    this rank got (or "no error")."""
    guard = CollectiveGuard(timeout_s=timeout_s)
    last = dist.get_rank() == dist.get_world_size() - 1
    try:
        for name in ("val/loss", "val/acc", "val/f1"):
            if not (last and name == skip):
                guard.all_reduce(torch.ones(2, dtype=torch.float64), name=name)
    except CollectiveMismatch as exc:
        return str(exc)
    return "no error"


def wrap(text: str, width: int = 96) -> str:
    """``text`` with every line folded at ``width`` columns (continuations indented)."""
    return "\n".join(
        textwrap.fill(line, width, subsequent_indent="    ", break_on_hyphens=False) or line
        for line in text.splitlines()
    )
