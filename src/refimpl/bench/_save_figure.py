"""The saving-overhead benchmark's figure and table (chapter 9), drawn from ``save.json``.

One panel per state size; per method, the time the training loop is blocked (dark) in front
of the time until the checkpoint is durable (light), medians with min-max error bars, on a
log scale (the floors and the blocking times are 10-50x shorter than the writes). Method
names are the JSON's identifiers; `LABELS` gives the words a reader sees.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LABELS", "overhead_figure", "overhead_table"]

LABELS = {
    "floor_memcpy": "memcpy into buffers (floor)",
    "floor_write_fsync": "one write + fsync (floor)",
    "torch_save": "torch.save, no fsync",
    "torch_save_fsync": "torch.save + fsync",
    "atomic_save": "refimpl atomic_save",
    "dcp_sync": "DCP save",
    "dcp_async": "DCP async, new copy each save",
    "dcp_async_staged": "DCP async, staged",
    "dcp_async_staged_low": "DCP async, staged, low-priority writer",
    "dcp_async_process": "DCP async, staged, process writer",
}


def _label(method: str) -> str:
    return LABELS.get(method, method)


def _size_name(nbytes: int) -> str:
    mib = nbytes >> 20
    return f"{mib >> 10} GiB" if mib >= 1024 and mib % 1024 == 0 else f"{mib} MiB"


def _sizes(data: dict[str, Any]) -> list[int]:
    return sorted({int(r["bytes"]) for r in data["rows"]})


BLOCKED = "training blocked (until the call returns)"
BACKGROUND = "written in the background, until durable"


def _is_async(row: dict[str, Any]) -> bool:
    return bool(row["method"].startswith("dcp_async"))


def _bars(
    ax: Any,
    rows: dict[str, dict[str, Any]],
    methods: list[str],
    which: list[int],
    kind: str,
    color: str,
    height: float | dict[int, float],
    label: str,
) -> None:
    """Bars for ``kind`` (blocking or total) at the positions ``which``: median, min-max."""
    med = [rows[methods[i]][f"{kind}_s_median"] for i in which]
    err = [
        [m - rows[methods[i]][f"{kind}_s_min"] for m, i in zip(med, which, strict=True)],
        [rows[methods[i]][f"{kind}_s_max"] - m for m, i in zip(med, which, strict=True)],
    ]
    heights = [height[i] for i in which] if isinstance(height, dict) else height
    ax.barh(
        which, med, height=heights, color=color, label=label, xerr=err,
        error_kw={"ecolor": "#333333", "capsize": 2.5, "elinewidth": 1},
    )  # fmt: skip


def overhead_figure(data: dict[str, Any]) -> Any:
    """The figure (a matplotlib ``Figure``) for the benchmark result ``data``."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    sizes = _sizes(data)
    methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
    fig, axes = plt.subplots(
        1, len(sizes), figsize=(4.6 * len(sizes) + 2.4, 0.42 * len(methods) + 1.9),
        sharey=True, squeeze=False,
    )  # fmt: skip
    y = list(range(len(methods)))
    for ax, nbytes in zip(axes[0], sizes, strict=True):
        rows = {r["method"]: r for r in data["rows"] if r["bytes"] == nbytes}
        background = [i for i, m in enumerate(methods) if _is_async(rows[m])]
        _bars(ax, rows, methods, background, "total", "#9ecae1", 0.78, BACKGROUND)
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
        handles[::-1], labels[::-1], loc="lower center", ncol=2, fontsize=10, frameon=False,
        title="bars: median of the timed repeats; whiskers: min to max", title_fontsize=10,
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0.72 / fig.get_figheight(), 1, 1))
    return fig


def overhead_table(data: dict[str, Any]) -> str:
    """The rows as a fixed-width table (seconds, medians): one line per method."""
    sizes = _sizes(data)
    methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
    rows = {(r["method"], r["bytes"]): r for r in data["rows"]}
    width = max(len(_label(m)) for m in methods)
    head = "".join(f"{_size_name(n) + ': blocked / total':>28}" for n in sizes)
    lines = [f"{'method':<{width}}{head}"]
    for m in methods:
        cells = "".join(
            f"{rows[m, n]['blocking_s_median']:>16.3f} s {rows[m, n]['total_s_median']:>7.3f} s"
            for n in sizes
        )
        lines.append(f"{_label(m):<{width}}{cells}")
    return "\n".join(lines)
