"""The book's conceptual diagrams, drawn by code so that anyone can regenerate them.

Each ``draw_*`` function returns a `matplotlib.figure.Figure` (no pyplot, so a chapter's
backend is never touched) showing one chapter's mechanism with boxes, arrows and timelines:
large type, few words, the Okabe-Ito colour-blind-safe palette, black text on light fills.
:func:`write_all` saves every diagram as SVG with a fixed hash salt and no date, so the same
code writes the same bytes; ``python -m refimpl.demos.diagrams [--out DIR]`` runs it
(default ``book/figures/diagrams``). ``tests/test_diagrams.py`` regenerates each file and
compares it with the committed one, so a drawing changed without regenerating fails.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

__all__ = [
    "DIAGRAMS",
    "Diagram",
    "draw_async_staging",
    "draw_atomic_save",
    "draw_bucket_fill",
    "draw_collective_order",
    "draw_collectives",
    "draw_dcp_commit",
    "draw_ddp_overlap",
    "draw_live_recovery",
    "draw_porting",
    "draw_rank0_save",
    "draw_save_interval",
    "draw_torchrun_restarts",
    "draw_training_state",
    "main",
    "write_all",
    "write_svg",
]

# Okabe-Ito: distinguishable with the common colour-vision deficiencies; black text on each
# fill below has a contrast ratio of at least 6:1 (white on BLUE, 5.3:1).
BLUE = "#0072B2"
SKY = "#56B4E9"
GREEN = "#009E73"
ORANGE = "#E69F00"
YELLOW = "#F0E442"
VERMILLION = "#D55E00"
PURPLE = "#CC79A7"
GREY = "#D9D9D9"
INK = "#111111"
BIG = 18
TEXT = 16
SMALL = 14
WIDTH_IN = 6.8  # 16 units across; type this large stays legible at 420 px
UNITS = 16.0


def _canvas(height_units: float) -> tuple[Figure, Axes]:
    """A blank figure WIDTH_IN wide whose axes run 0..16 across and 0..height_units up."""
    fig = Figure(figsize=(WIDTH_IN, WIDTH_IN * height_units / UNITS))
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    ax.set_xlim(0, UNITS)
    ax.set_ylim(0, height_units)
    ax.axis("off")
    return fig, ax


def _box(
    ax: Axes,
    x: float,
    y: float,
    w: float,
    h: float,
    text: str,
    fill: str,
    *,
    color: str = INK,
    size: float = TEXT,
    hatch: str | None = None,
    bold: bool = False,
) -> None:
    """A rounded box with centred text; (x, y) is its lower-left corner."""
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0,rounding_size=0.15",
            facecolor=fill,
            edgecolor=INK,
            linewidth=1.5,
            hatch=hatch,
        )
    )
    if text:
        weight = "bold" if bold else "normal"
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)
        ax.texts[-1].set(color=color, weight=weight, linespacing=1.15)


def _arrow(
    ax: Axes,
    start: tuple[float, float],
    end: tuple[float, float],
    *,
    color: str = INK,
    rad: float = 0.0,
    dashed: bool = False,
    both: bool = False,
) -> None:
    """An arrow from start to end (curved when rad is not 0)."""
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="<|-|>" if both else "-|>",
            mutation_scale=20,
            linewidth=2.2,
            color=color,
            linestyle="--" if dashed else "-",
            connectionstyle=f"arc3,rad={rad}",
            shrinkA=0,
            shrinkB=0,
        )
    )


def _label(
    ax: Axes,
    x: float,
    y: float,
    text: str,
    *,
    size: float = TEXT,
    ha: str = "center",
    weight: str = "normal",
    style: str = "normal",
    rotation: float = 0.0,
    color: str = INK,
) -> None:
    """Free text centred vertically on y (a lane's name, an arrow's label)."""
    ax.text(x, y, text, ha=ha, va="center", fontsize=size, color=color, linespacing=1.15)
    ax.texts[-1].set(weight=weight, style=style, rotation=rotation)


def draw_ddp_overlap() -> Figure:
    """DDP's backward: per-parameter hooks fill buckets, a full bucket's all-reduce overlaps
    the rest of backward, and the step waits for the last all-reduce (chapter 2)."""
    fig, ax = _canvas(8.6)
    lanes = {"backward": 6.4, "buckets": 4.0, "all-reduce": 1.6}
    for name, y in lanes.items():
        _label(ax, 0.15, y + 0.55, name, ha="left", weight="bold")
    h = 1.1
    grads = [(3.2, "grad 4"), (5.3, "grad 3"), (7.4, "grad 2"), (9.5, "grad 1")]
    for x, text in grads:
        _box(ax, x, lanes["backward"], 2.0, h, text, SKY)
        _arrow(ax, (x + 1.0, lanes["backward"]), (x + 1.0, lanes["buckets"] + h))
    _label(ax, 4.2 + 1.05, lanes["buckets"] + h + 0.65, "hook", size=SMALL, style="italic")
    _box(ax, 3.2, lanes["buckets"], 4.1, h, "bucket 0", ORANGE)
    _box(ax, 7.4, lanes["buckets"], 4.1, h, "bucket 1", ORANGE)
    _box(ax, 7.4, lanes["all-reduce"], 3.9, h, "all-reduce 0", BLUE, color="white", size=SMALL)
    _box(ax, 11.6, lanes["all-reduce"], 2.95, h, "all-reduce 1", BLUE, color="white", size=SMALL)
    _arrow(ax, (7.0, lanes["buckets"]), (7.6, lanes["all-reduce"] + h))
    _arrow(ax, (11.2, lanes["buckets"]), (11.8, lanes["all-reduce"] + h))
    _box(ax, 11.6, lanes["backward"], 2.95, h, "wait", GREY)
    _box(ax, 14.65, lanes["backward"], 1.25, h, "step", GREEN, size=SMALL)
    _arrow(ax, (7.4, 0.75), (11.5, 0.75), both=True)
    _label(ax, 9.45, 0.3, "overlaps backward", size=SMALL)
    _arrow(ax, (12.6, 0.55), (15.8, 0.55))
    _label(ax, 14.2, 0.95, "time", size=SMALL)
    return fig


def draw_atomic_save() -> Figure:
    """The atomic save's four steps and what a crash after each leaves (chapter 5)."""
    fig, ax = _canvas(9.6)
    _label(ax, 4.0, 9.0, "step", weight="bold", size=BIG)
    _label(ax, 12.35, 9.0, "left by a crash", weight="bold", size=BIG)
    steps = [
        ("1  write temp file", "old checkpoint", ORANGE),
        ("2  fsync(temp)", "old checkpoint", ORANGE),
        ("3  rename temp → ckpt", "new\n(power cut: old or new)", SKY),
        ("4  fsync(directory)", "new, durable", GREEN),
    ]
    h = 1.45
    for i, (step, left, fill) in enumerate(steps):
        y = 6.9 - i * 1.95
        _box(ax, 0.2, y, 7.6, h, step, "white", size=BIG)
        _arrow(ax, (7.9, y + h / 2), (8.9, y + h / 2))
        _box(ax, 9.0, y, 6.7, h, left, fill, size=TEXT)
    _label(ax, 8.0, 0.55, "never a torn file; a stray temp is removed by the next save", size=SMALL)
    return fig


def draw_dcp_commit() -> Figure:
    """refimpl's sharded save: shards into a hidden temporary step directory, DCP's
    .metadata last, digests gathered, then rank 0 commits and renames (chapter 8)."""
    fig, ax = _canvas(12.4)
    cols = {"rank 0": 0.2, "rank 1": 5.5, "disk": 10.8}
    w, h = 4.9, 1.15
    for name, x in cols.items():
        _label(ax, x + w / 2, 11.8, name, weight="bold", size=BIG)
    rows = [10.2, 8.6, 7.0, 5.4, 3.8, 1.4]
    r0, r1, disk = cols["rank 0"], cols["rank 1"], cols["disk"]
    _box(ax, r0, rows[0], w, h, "make tmp dir", BLUE, color="white")
    _arrow(ax, (r0 + w, rows[0] + h / 2), (r1 + 0.9, rows[0] + h / 2))
    _label(ax, r1 + 2.4, rows[0] + h / 2, "its name", size=SMALL, style="italic")
    _box(ax, r0, rows[1], w, h, "write shard 0", SKY)
    _box(ax, r1, rows[1], w, h, "write shard 1", SKY)
    _box(ax, r0, rows[2], w, h, "write .metadata", ORANGE)
    _box(ax, r0, rows[3], w, h, "digest own files", SKY)
    _box(ax, r1, rows[3], w, h, "digest own files", SKY)
    _arrow(ax, (r1, rows[3] + h / 2), (r0 + w, rows[3] + h / 2))
    _box(ax, r0, rows[4], w, h, "MANIFEST,\nCOMMITTED", GREEN, size=SMALL)
    _box(ax, r0, rows[5], w, h, "rename, fsync", GREEN, bold=True)
    hidden = [".step_N.tmp/", "+ shards", "+ .metadata", "", "+ manifest"]
    for y, text in zip(rows[:5], hidden, strict=True):
        if text:
            _box(ax, disk, y, w, h, text, GREY)
    _box(ax, disk, rows[5], w, h, "step_N/", GREEN, bold=True, size=BIG)
    _arrow(ax, (r0 + w, rows[5] + h / 2), (disk, rows[5] + h / 2))
    ax.plot([0.2, 15.8], [3.0, 3.0], color=VERMILLION, linewidth=2.2, linestyle="--")
    _label(ax, 8.0, 3.3, "killed above the line: nothing published", size=SMALL)
    _arrow(ax, (15.85, 11.3), (15.85, 0.6))
    _label(ax, 15.55, 6.2, "time", size=SMALL, rotation=90.0)
    return fig


def draw_async_staging() -> Figure:
    """An async save: the caller blocks only for the copy into staging buffers, the
    background writes, fsyncs and commits, and the next save waits for it (chapter 9)."""
    fig, ax = _canvas(7.6)
    train, back, h = 4.6, 1.6, 1.2
    _label(ax, 0.15, train + h + 1.2, "training", ha="left", weight="bold")
    _label(ax, 0.15, back + h + 0.55, "background", ha="left", weight="bold")
    for x in (0.2, 5.55, 6.95, 8.35, 13.5):
        _box(ax, x, train, 1.25, h, "step", "white")
    _box(ax, 1.6, train, 3.8, h, "copy", ORANGE, bold=True)
    _box(ax, 9.75, train, 1.9, h, "wait", VERMILLION, bold=True)
    _box(ax, 11.75, train, 1.6, h, "copy", ORANGE, bold=True)
    _label(ax, 1.6, train + h + 0.5, "save()", size=SMALL, ha="left", style="italic")
    _label(ax, 9.75, train + h + 0.5, "save()", size=SMALL, ha="left", style="italic")
    _arrow(ax, (5.4, train), (5.8, back + h))
    _box(ax, 5.6, back, 4.0, h, "write + fsync", SKY)
    _box(ax, 9.7, back, 2.0, h, "commit", GREEN, size=SMALL)
    _arrow(ax, (11.5, back + h), (11.7, train))
    _arrow(ax, (13.2, train), (13.6, back + h))
    _box(ax, 13.5, back, 2.4, h, "write …", SKY)
    _label(ax, 3.55, 0.85, "blocked: the copy only", size=SMALL)
    _label(ax, 10.75, 0.85, "one save in flight", size=SMALL)
    _arrow(ax, (1.6, 0.35), (5.5, 0.35), both=True)
    _arrow(ax, (9.8, 0.35), (11.7, 0.35), both=True)
    return fig


def draw_torchrun_restarts() -> Figure:
    """The torchrun agent's loop: rendezvous, start the workers, monitor them; on a failure
    stop them all and start again while restarts are left (chapter 10)."""
    fig, ax = _canvas(10.4)
    w, h = 6.2, 1.3
    left, right = 0.2, 9.6
    _box(ax, left, 8.6, w, h, "rendezvous", SKY, size=BIG)
    _box(ax, left, 6.2, w, h, "start all workers", SKY, size=BIG)
    _box(ax, left, 3.8, w, h, "monitor, every 0.1 s", SKY, size=BIG)
    _box(ax, left, 0.4, w, h, "all done: exit 0", GREEN, size=BIG)
    _box(ax, right, 8.6, w, h, "stop all workers", ORANGE, size=BIG)
    _box(ax, right, 3.8, w, h, "restarts left?", YELLOW, size=BIG)
    _box(ax, right, 0.4, w, h, "stop all: job fails", VERMILLION, size=BIG)
    cx, rx = left + w / 2, right + w / 2
    _arrow(ax, (cx, 8.6), (cx, 6.2 + h))
    _arrow(ax, (cx, 6.2), (cx, 3.8 + h))
    _arrow(ax, (cx, 3.8), (cx, 0.4 + h))
    _label(ax, cx + 0.2, 2.65, "all succeeded", ha="left", size=SMALL)
    _arrow(ax, (left + w, 3.8 + h / 2), (right, 3.8 + h / 2))
    _label(ax, 8.0, 3.8 + h / 2 - 0.55, "one failed", size=SMALL)
    _arrow(ax, (rx, 3.8 + h), (rx, 8.6))
    _label(ax, rx - 0.2, 7.5, "yes: restarts − 1", ha="right", size=SMALL)
    _arrow(ax, (rx, 3.8), (rx, 0.4 + h))
    _label(ax, rx + 0.2, 2.65, "no", ha="left", size=SMALL)
    _arrow(ax, (right, 8.6 + h / 2), (left + w, 8.6 + h / 2))
    _label(ax, 8.0, 8.6 + h / 2 + 0.55, "new round", size=SMALL)
    _arrow(ax, (left + w, 3.8 + h), (right + 0.3, 8.6), dashed=True)
    _label(ax, 8.3, 6.0, "node joins:\nfree restart", size=SMALL, ha="left")
    return fig


def draw_save_interval() -> Figure:
    """What a failure costs a job that saves every tau of work: C per save, the work since
    the last save lost, the restart R, and the interval that balances them (chapter 11)."""
    fig, ax = _canvas(7.4)
    y, h = 3.9, 1.3
    _box(ax, 0.2, y, 2.9, h, "work τ", SKY)
    _box(ax, 3.2, y, 0.9, h, "C", ORANGE, bold=True)
    _box(ax, 4.2, y, 2.9, h, "work τ", SKY)
    _box(ax, 7.2, y, 0.9, h, "C", ORANGE, bold=True)
    _box(ax, 8.2, y, 2.4, h, "lost", GREY)
    _box(ax, 10.7, y, 1.5, h, "fail", VERMILLION, bold=True)
    _box(ax, 12.3, y, 1.2, h, "R", YELLOW, bold=True)
    _box(ax, 13.6, y, 2.2, h, "redo", SKY)
    _label(ax, 4.15, 6.6, "a save every τ of work", size=SMALL)
    _arrow(ax, (3.65, 6.15), (3.65, y + h))
    _arrow(ax, (7.65, 6.15), (7.65, y + h))
    _label(ax, 11.45, 6.6, "a failure", size=SMALL)
    _arrow(ax, (11.45, 6.15), (11.45, y + h))
    _arrow(ax, (8.2, 3.3), (10.7, 3.3), both=True)
    _label(ax, 9.45, 2.6, "τ/2 lost, on average", size=SMALL)
    _label(ax, 8.0, 1.2, "waste ≈ C/τ + τ/(2M) + R/M", size=BIG)
    _label(ax, 8.0, 0.4, "least at τ ≈ √(2CM)", size=TEXT, weight="bold")
    return fig


def draw_collectives() -> Figure:
    """The four collectives on three ranks, each rank's tensor before and after (chapter 1)."""
    fig, ax = _canvas(13.0)
    panels = [
        ("broadcast", 0.0, 6.6, ["a", "", ""], ["a", "a", "a"]),
        ("all-reduce", 8.1, 6.6, ["1", "2", "3"], ["6", "6", "6"]),
        ("all-gather", 0.0, 0.2, ["a", "b", "c"], ["a b c"] * 3),
        ("reduce-scatter", 8.1, 0.2, ["1 2 3"] * 3, ["3", "6", "9"]),
    ]
    for title, x0, y0, before, after in panels:
        _label(ax, x0 + 3.95, y0 + 5.75, title, weight="bold", size=BIG)
        for r in range(3):
            y = y0 + 3.6 - r * 1.55
            _label(ax, x0 + 0.2, y + 0.55, f"rank {r}", ha="left", size=SMALL)
            fill = SKY if before[r] else "white"
            _box(ax, x0 + 1.75, y, 2.3, 1.1, before[r], fill, size=BIG)
            _arrow(ax, (x0 + 4.15, y + 0.55), (x0 + 5.05, y + 0.55))
            _box(ax, x0 + 5.15, y, 2.5, 1.1, after[r], GREEN, size=BIG)
    ax.plot([8.0, 8.0], [0.3, 12.6], color=GREY, linewidth=2)
    ax.plot([0.2, 15.8], [6.4, 6.4], color=GREY, linewidth=2)
    return fig


def draw_bucket_fill() -> Figure:
    """Gradients arrive last layer first and fill buckets up to the cap; each full bucket's
    all-reduce is launched from the hook while backward goes on, and only the last one is
    left after the last gradient: the tail (chapter 3)."""
    fig, ax = _canvas(9.4)
    lanes = {"gradients": 6.6, "buckets": 4.0, "all-reduce": 1.6}
    for name, y in lanes.items():
        _label(ax, 0.15, y + 0.55, name, ha="left", weight="bold")
    h, w, gap, x0 = 1.1, 1.7, 0.1, 3.2
    fills = [SKY, SKY, ORANGE, ORANGE, PURPLE]
    xs = [x0 + i * (w + gap) for i in range(5)]
    for i, (x, fill) in enumerate(zip(xs, fills, strict=True)):
        _box(ax, x, lanes["gradients"], w, h, f"L{5 - i}", fill)
    _label(ax, x0, lanes["gradients"] + h + 0.55, "last layer first", size=SMALL, ha="left")
    _arrow(ax, (9.0, lanes["gradients"] + h + 0.55), (12.1, lanes["gradients"] + h + 0.55))
    buckets = [(xs[0], xs[1] + w, "bucket 0", SKY), (xs[2], xs[3] + w, "bucket 1", ORANGE)]
    buckets.append((xs[4], xs[4] + w, "2", PURPLE))
    for start, end, text, fill in buckets:
        _box(ax, start, lanes["buckets"], end - start, h, text, fill)
        _arrow(ax, (end - 0.45, lanes["gradients"]), (end - 0.45, lanes["buckets"] + h))
    runs = [(xs[2], 2.8, "0", SKY), (xs[4], 2.8, "1", ORANGE), (xs[4] + 2.9, 1.7, "2", PURPLE)]
    for start, length, text, fill in runs:
        _box(ax, start, lanes["all-reduce"], length, h, text, fill)
    for (_, end, _, _), (start, _, _, _) in zip(buckets, runs, strict=True):
        _arrow(ax, (end, lanes["buckets"]), (start + 0.25, lanes["all-reduce"] + h))
    tail_start, tail_end = xs[4] + w, xs[4] + 2.9 + 1.7
    ax.plot([tail_start] * 2, [0.3, 7.9], color=VERMILLION, linewidth=2.0, linestyle="--")
    _arrow(ax, (tail_start, 0.75), (tail_end, 0.75), both=True, color=VERMILLION)
    _label(ax, tail_start + 0.15, 8.25, "last gradient", size=SMALL, ha="left")
    _label(ax, x0, 0.75, "full bucket: all-reduce starts", size=SMALL, ha="left")
    _label(ax, (tail_start + tail_end) / 2, 0.3, "tail", size=SMALL, color=VERMILLION)
    return fig


def draw_rank0_save() -> Figure:
    """Rank 0 saves while the others wait: under the training timeout they give up; in a
    barrier with a budget of its own they wait the save out (chapter 4)."""
    fig, ax = _canvas(12.2)
    t0, per_s, h = 3.1, 2.3, 1.0

    def at(seconds: float) -> float:
        return t0 + seconds * per_s

    panels = [
        (6.4, "next collective, 2 s timeout", False),
        (0.4, "barrier_safe, 10 s budget", True),
    ]
    for y0, title, safe in panels:
        _label(ax, 8.0, y0 + 5.35, title, weight="bold", size=BIG)
        for r in range(3):
            y = y0 + 3.3 - r * 1.45
            _label(ax, 0.2, y + h / 2, f"rank {r}", ha="left")
            if r == 0:
                _box(ax, at(0), y, at(3.5) - at(0), h, "save, 3.5 s", ORANGE)
            elif safe:
                _box(ax, at(0), y, at(3.5) - at(0), h, "wait", GREY)
            else:
                _box(ax, at(0), y, at(2) - at(0), h, "wait", GREY)
                _box(ax, at(2) + 0.1, y, 2.7, h, "timeout", VERMILLION, bold=True)
            if safe:
                _box(ax, at(3.5) + 0.1, y, 2.5, h, "train on", GREEN)
        ax.plot([at(2), at(2)], [y0 + 0.45, y0 + 4.6], color=INK, lw=1.5, ls=":", zorder=0.5)
        _label(ax, at(2), y0 + 0.05, "2 s", size=SMALL)
    return fig


def draw_training_state() -> Figure:
    """Everything a checkpoint must hold for a resume that continues bit for bit (chapter 6)."""
    fig, ax = _canvas(8.4)
    parts = [
        "weights",
        "optimizer",
        "LR schedule",
        "grad scaler",
        "RNG, every rank",
        "data position",
    ]
    for i, text in enumerate(parts):
        y = 6.9 - i * 1.3
        _box(ax, 0.2, y, 5.2, 1.0, text, SKY)
        ax.plot([5.4, 6.4], [y + 0.5, 4.1], color=INK, linewidth=2)
    _arrow(ax, (6.4, 4.1), (7.05, 4.1))
    _box(ax, 7.1, 3.35, 3.4, 1.5, "checkpoint\nstep N", ORANGE, size=BIG)
    _arrow(ax, (10.6, 4.1), (11.5, 4.1))
    _box(ax, 11.6, 2.9, 4.2, 2.4, "resume:\nsame batches,\nsame numbers", GREEN)
    _label(ax, 13.7, 1.6, "miss one:\na different run", size=SMALL, color=VERMILLION)
    return fig


def draw_collective_order() -> Figure:
    """Collectives are matched by their position in each rank's sequence of calls: ranks
    that draw different datasets pair different calls (chapter 7)."""
    fig, ax = _canvas(11.6)
    panels = [
        (6.0, "each rank draws its own dataset", [["seg", "seg", "det"], ["det", "seg", "seg"]]),
        (0.2, "the same dataset on every rank", [["seg", "det", "seg"], ["seg", "det", "seg"]]),
    ]
    w, h = 3.3, 1.0
    for y0, title, calls in panels:
        _label(ax, 8.0, y0 + 4.85, title, weight="bold", size=BIG)
        for r, row in enumerate(calls):
            y = y0 + 3.1 - r * 2.6
            _label(ax, 0.2, y + h / 2, f"rank {r}", ha="left")
            for i, name in enumerate(row):
                fill = ORANGE if name == "seg" else PURPLE
                _box(ax, 2.8 + i * 4.4, y, w, h, f"#{i} {name}", fill)
        for i in range(3):
            same = calls[0][i] == calls[1][i]
            x = 2.8 + i * 4.4 + w / 2
            ax.plot(
                [x, x],
                [y0 + 3.1, y0 + 0.5 + h],
                color=GREEN if same else VERMILLION,
                linewidth=3,
                linestyle="-" if same else "--",
            )
            _label(ax, x + 0.25, y0 + 2.05, "ok" if same else "mismatch", ha="left", size=SMALL)
    return fig


def draw_live_recovery() -> Figure:
    """torchft: one replica group dies, the others keep stepping, and its replacement copies
    the weights from a live peer and rejoins (chapter 13)."""
    fig, ax = _canvas(8.0)
    x0, per_step, h = 3.0, 0.52, 1.0

    def at(step: float) -> float:
        return x0 + (step - 1) * per_step

    lanes = {"group 0": 5.6, "group 1": 3.6, "group 2": 1.6}
    for name, y in lanes.items():
        _label(ax, 0.2, y + h / 2, name, ha="left", weight="bold")
        if name == "group 1":
            _box(ax, at(1), y, at(8) - at(1), h, "train", SKY)
            _box(ax, at(8), y, 1.2, h, "kill", VERMILLION, size=SMALL, bold=True)
            _box(ax, at(8) + 1.3, y, at(16) - at(8) - 1.3, h, "heal", ORANGE)
            _box(ax, at(16), y, at(25) - at(16), h, "train", SKY)
        else:
            _box(ax, at(1), y, at(25) - at(1), h, "train, every step", SKY)
    _arrow(ax, (at(14), lanes["group 0"]), (at(14), lanes["group 1"] + h))
    _label(ax, at(14) + 0.2, 5.05, "weights", ha="left", size=SMALL)
    for step in (1, 8, 16, 24):
        _label(ax, at(step) + per_step / 2, 7.3, f"{step}", size=SMALL)
    _label(ax, 0.2, 7.3, "step", ha="left", size=SMALL)
    _label(ax, 8.0, 0.8, "steps 8-15: a quorum of two groups, no stop", size=SMALL)
    return fig


def draw_porting() -> Figure:
    """The port: every rank captures its state before rank 0's evaluation, rank 0 saves it,
    every rank resumes its own; the kill test compares a killed run with an uninterrupted
    one (chapter 12)."""
    fig, ax = _canvas(12.4)
    h = 1.3
    _label(ax, 8.0, 11.8, "capture, save, resume", weight="bold", size=BIG)
    for r, y in ((0, 9.2), (1, 6.9)):
        _label(ax, 0.2, y + h / 2, f"rank {r}", ha="left")
        _box(ax, 2.3, y, 2.9, h, "capture", ORANGE)
        if r == 0:
            _box(ax, 5.4, y, 1.9, h, "eval", GREY)
            _box(ax, 7.5, y, 2.7, h, "save N", GREEN, bold=True)
        else:
            _box(ax, 5.4, y, 4.8, h, "train", GREY)
        _box(ax, 11.3, y, 4.5, h, "resume\nits own RNG", SKY, size=SMALL)
    _arrow(ax, (3.75, 6.9 + h), (3.75, 9.2))
    _label(ax, 4.0, 8.85, "RNG", ha="left", size=SMALL)
    ax.plot([10.75, 10.75], [6.6, 10.9], color=VERMILLION, lw=3, ls="--")
    _label(ax, 10.75, 11.1, "kill", size=SMALL, color=VERMILLION, weight="bold")
    _label(ax, 8.0, 5.3, "the kill test", weight="bold", size=BIG)
    for name, y in (("reference", 3.1), ("killed", 0.4)):
        _label(ax, 0.2, y + h / 2, name, ha="left")
        if name == "reference":
            _box(ax, 3.4, y, 8.6, h, "steps 0 to 12", SKY)
        else:
            _box(ax, 3.4, y, 2.6, h, "0 to 6", SKY)
            _box(ax, 6.1, y, 1.5, h, "kill", VERMILLION, bold=True)
            _box(ax, 7.7, y, 4.3, h, "resume at 4", GREEN)
        _box(ax, 12.4, y, 3.4, h, "final.pt", ORANGE)
    _arrow(ax, (14.1, 0.4 + h), (14.1, 3.1), both=True)
    _label(ax, 13.8, 2.4, "same bits?", ha="right", size=SMALL)
    return fig


@dataclass(frozen=True)
class Diagram:
    """One diagram: the file name it is saved under (``<name>.svg``), the chapter it belongs
    to, and the function that draws it."""

    name: str
    chapter: int
    draw: Callable[[], Figure]


DIAGRAMS: tuple[Diagram, ...] = (
    Diagram("ch01_collectives", 1, draw_collectives),
    Diagram("ch02_ddp_overlap", 2, draw_ddp_overlap),
    Diagram("ch03_bucket_fill", 3, draw_bucket_fill),
    Diagram("ch04_rank0_save", 4, draw_rank0_save),
    Diagram("ch05_atomic_save", 5, draw_atomic_save),
    Diagram("ch06_training_state", 6, draw_training_state),
    Diagram("ch07_collective_order", 7, draw_collective_order),
    Diagram("ch08_dcp_commit", 8, draw_dcp_commit),
    Diagram("ch09_async_staging", 9, draw_async_staging),
    Diagram("ch10_torchrun_restarts", 10, draw_torchrun_restarts),
    Diagram("ch11_save_interval", 11, draw_save_interval),
    Diagram("ch12_porting", 12, draw_porting),
    Diagram("ch13_live_recovery", 13, draw_live_recovery),
)
"""Every diagram of the book, in chapter order (``python -m refimpl.demos.diagrams`` draws
them into ``book/figures/diagrams``)."""

DEFAULT_OUT = Path("book") / "figures" / "diagrams"


def write_svg(fig: Figure, path: Path) -> Path:
    """Save ``fig`` as SVG at ``path``, byte for byte the same on every run.

    Text becomes paths (no font needed to view it), element ids come from a fixed hash salt,
    and the date and creator are left out, so regenerating an unchanged drawing changes no
    byte. Raises `OSError` when ``path`` cannot be written.
    """
    with matplotlib.rc_context({"svg.hashsalt": "refimpl-diagrams", "svg.fonttype": "path"}):
        fig.savefig(path, format="svg", metadata={"Date": None, "Creator": None})
    return path


def write_all(out: Path = DEFAULT_OUT) -> list[Path]:
    """Draw every diagram in `DIAGRAMS` into ``out`` (created if missing) as ``<name>.svg``.

    Returns the paths written, in `DIAGRAMS` order. Raises `OSError` when ``out`` cannot be
    created or written.
    """
    out.mkdir(parents=True, exist_ok=True)
    return [write_svg(d.draw(), out / f"{d.name}.svg") for d in DIAGRAMS]


def main(argv: list[str] | None = None) -> int:
    """``python -m refimpl.demos.diagrams [--out DIR]``: regenerate every diagram."""
    parser = argparse.ArgumentParser(prog="python -m refimpl.demos.diagrams", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the SVGs")
    args = parser.parse_args(argv)
    for path in write_all(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
