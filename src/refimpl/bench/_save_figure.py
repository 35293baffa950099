"""The saving-overhead benchmark's figure and table (chapter 9), drawn from ``save.json``.

One panel per state size; per method, the time the training loop is blocked (dark) in front
of the time until the checkpoint is durable (light), medians with min-max error bars, on a
log scale (the floors and the blocking times are 10-50x shorter than the writes). Method
names are the JSON's identifiers; `LABELS` gives the words a reader sees.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LABELS", "blocking_estimate_figure", "overhead_figure", "overhead_table"]

LABELS = {
    "floor_memcpy": "memcpy into buffers (floor)",
    "floor_write_fsync": "one write + fsync (floor)",
    "torch_save": "torch.save, no fsync",
    "torch_save_fsync": "torch.save + fsync",
    "atomic_save": "refimpl atomic_save",
    "dcp_sync": "DCP save",
    "dcp_async": "DCP async,\nnew copy each save",
    "dcp_async_staged": "DCP async, staged",
    "dcp_async_staged_low": "DCP async, staged,\nlow-priority writer",
    "dcp_async_process": "DCP async, staged,\nprocess writer",
    "save_checkpoint": "refimpl save_checkpoint",
    "async_checkpoint": "refimpl AsyncCheckpointer",
}


def _label(method: str) -> str:
    return LABELS.get(method, method)


def _flat(method: str) -> str:
    return _label(method).replace("\n", " ")


def _size_name(nbytes: int) -> str:
    mib = nbytes >> 20
    return f"{mib >> 10} GiB" if mib >= 1024 and mib % 1024 == 0 else f"{mib} MiB"


def _sizes(data: dict[str, Any]) -> list[int]:
    return sorted({int(r["bytes"]) for r in data["rows"]})


BLOCKED = "training blocked (until the call returns)"
BACKGROUND = "written in the background, until durable"


def _is_async(row: dict[str, Any]) -> bool:
    return bool(row["method"].startswith("dcp_async") or row["method"] == "async_checkpoint")


def _bars(
    ax: Any,
    rows: dict[str, dict[str, Any]],
    methods: list[str],
    which: list[int],
    kind: str,
    color: str,
    height: float | dict[int, float],
    label: str,
    whisker_offset: float = 0.0,
) -> None:
    """Bars for ``kind`` (blocking or total) at the positions ``which``: the median, and
    min-max whiskers drawn ``whisker_offset`` off the bar's centre line."""
    med = [rows[methods[i]][f"{kind}_s_median"] for i in which]
    err = [
        [m - rows[methods[i]][f"{kind}_s_min"] for m, i in zip(med, which, strict=True)],
        [rows[methods[i]][f"{kind}_s_max"] - m for m, i in zip(med, which, strict=True)],
    ]
    heights = [height[i] for i in which] if isinstance(height, dict) else height
    ax.barh(which, med, height=heights, color=color, label=label)
    ax.errorbar(
        med,
        [i + whisker_offset for i in which],
        xerr=err,
        fmt="none",
        ecolor="#333333",
        capsize=2.5,
        elinewidth=1,
    )


def overhead_figure(data: dict[str, Any]) -> Any:
    """The figure (a matplotlib ``Figure``, made without pyplot: no backend is chosen or
    changed, and a notebook displays the returned figure) for the benchmark result ``data``."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    sizes = _sizes(data)
    methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
    fig = Figure(figsize=(3.0 * len(sizes) + 2.2, 0.44 * len(methods) + 1.9))
    axes = fig.subplots(1, len(sizes), sharey=True, squeeze=False)
    y = list(range(len(methods)))
    for ax, nbytes in zip(axes[0], sizes, strict=True):
        rows = {r["method"]: r for r in data["rows"] if r["bytes"] == nbytes}
        background = [i for i, m in enumerate(methods) if _is_async(rows[m])]
        _bars(ax, rows, methods, background, "total", "#9ecae1", 0.78, BACKGROUND, -0.29)
        thin = {i: 0.4 if i in background else 0.78 for i in y}
        _bars(ax, rows, methods, y, "blocking", "#08519c", thin, BLOCKED)
        ax.set_xscale("log")
        ax.set_xlim(0.01, 10)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.grid(axis="x", which="major", color="#dddddd", lw=0.8)
        ax.set_axisbelow(True)
        ax.set_title(f"{_size_name(nbytes)} of float32 state", fontsize=11)
        ax.set_xlabel("seconds per save (log scale)", fontsize=10)
        ax.tick_params(labelsize=10)
    axes[0][0].set_yticks(y, [_label(m) for m in methods])
    axes[0][0].invert_yaxis()
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(
        handles[::-1],
        labels[::-1],
        loc="lower center",
        ncol=2,
        fontsize=10,
        frameon=False,
        title="bars: median of the timed repeats; whiskers: min to max",
        title_fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.72 / fig.get_figheight(), 1, 1))
    return fig


def overhead_table(data: dict[str, Any]) -> str:
    """The rows as a fixed-width table (seconds, medians): one line per method."""
    sizes = _sizes(data)
    methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
    rows = {(r["method"], r["bytes"]): r for r in data["rows"]}
    width = max(len(_flat(m)) for m in methods)
    # two header lines, so that two sizes fit in a book's 80 columns
    lines = [f"{'':<{width}}" + "".join(f"{_size_name(n):>19}" for n in sizes)]
    lines.append(f"{'method':<{width}}" + f"{'blocked':>11}{'total':>8}" * len(sizes))
    for m in methods:
        cells = "".join(
            f"{rows[m, n]['blocking_s_median']:>9.3f} s{rows[m, n]['total_s_median']:>6.3f} s"
            for n in sizes
        )
        lines.append(f"{_flat(m):<{width}}{cells}")
    return "\n".join(lines)


def blocking_estimate_figure(state_gib: float, disk_gibps: float, copy_gibps: float) -> Any:
    """Seconds training is blocked per save, as arithmetic on two throughputs: a synchronous
    save writes ``state_gib`` at ``disk_gibps``, a staged async save copies it at
    ``copy_gibps``. The floors only: real saves add fixed costs (planning, metadata).
    A matplotlib ``Figure`` made without pyplot, like `overhead_figure`."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    sync_s, async_s = state_gib / disk_gibps, state_gib / copy_gibps
    fig = Figure(figsize=(7.5, 2.4))
    ax = fig.subplots()
    ax.barh(
        ["sync save\n(write + fsync)", "staged async\n(one copy)"],
        [sync_s, async_s],
        color=["#e6550d", "#08519c"],
        height=0.6,
    )
    for yi, seconds in enumerate((sync_s, async_s)):
        ax.text(seconds * 1.15, yi, f"{seconds:.3g} s", va="center", fontsize=10)
    ax.set_xscale("log")
    ax.set_xlim(0.01, 1000)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.invert_yaxis()
    ax.tick_params(labelsize=10)
    ax.set_xlabel("seconds training is blocked per save (log scale)", fontsize=10)
    ax.set_title(
        f"{state_gib:.3g} GiB per rank, storage {disk_gibps:.3g} GiB/s, copy "
        f"{copy_gibps:.3g} GiB/s: async blocks {sync_s / async_s:.0f}x less",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
