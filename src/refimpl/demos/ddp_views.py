"""Chapter 2's pictures and compact printouts of DDP's buckets.

`plot_hook_trace` draws what `refimpl.demos.buckets.ddp_hook_trace` recorded inside a real
`DistributedDataParallel`: when each gradient became ready and when each bucket's
all-reduce ran, one panel per step, stacked, with a legend for the buckets. `compact`
writes a bucket layout in a few characters, so that a table of layouts fits a page.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compact", "plot_hook_trace"]


def compact(buckets: list[list[int]]) -> str:
    """A bucket layout as parameter indices, ``|`` between buckets.

    ``[[5, 4, 3, 2], [1, 0]]`` becomes ``"5432|10"`` (indices above 9 are comma-separated
    inside their bucket, so the result stays unambiguous).
    """
    sep = "," if any(i > 9 for bucket in buckets for i in bucket) else ""
    return "|".join(sep.join(str(i) for i in bucket) for bucket in buckets)


def _layer(name: str) -> str:
    return name.rsplit(".", 1)[0]


def plot_hook_trace(trace: dict[str, Any], steps: tuple[int, ...] = (0, 2)) -> Any:
    """Draw steps of a `ddp_hook_trace` result, one panel each, stacked on a shared time axis.

    In each panel a row is a layer (its weight's and its bias's gradients: two dots, almost
    on top of each other), a dot is the moment autograd made a gradient ready, coloured by
    the bucket that holds it; below the layers, a bar per bucket runs from its all-reduce's
    launch to its completion, in the bucket's colour; the dashed line is the moment
    ``backward()`` returned. Sized for a page about 780 px wide: no text under 10 pt.
    Returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    names: list[str] = trace["names"]
    layers = list(dict.fromkeys(_layer(n) for n in names))  # definition order
    row = {i: layers.index(_layer(n)) for i, n in enumerate(names)}
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(len(steps), 1, figsize=(7.8, 2.9 * len(steps) + 0.7), sharex=True)
    axes = list(axes) if len(steps) > 1 else [axes]
    most = 0
    for ax, s in zip(axes, steps, strict=True):
        step = trace["steps"][s]
        buckets = step["buckets"]
        most = max(most, len(buckets))
        bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket}
        launched: dict[int, float] = {}
        for t, kind, i in step["events"]:
            if kind == "grad":
                ax.plot(1e3 * t, row[i], "o", color=colors(bucket_of[i] % 10), markersize=6)
            elif kind == "launch":
                launched[i] = 1e3 * t
            elif kind == "done" and i in launched:
                ax.barh(
                    -1.2 - i,
                    1e3 * t - launched[i],
                    left=launched[i],
                    height=0.7,
                    color=colors(i % 10),
                )
        ax.axvline(1e3 * step["backward_returned"], color="black", linestyle="--", linewidth=1)
        ticks = list(range(len(layers))) + [-1.2 - b for b in range(len(buckets))]
        labels = [f"layer {name}" for name in layers]
        labels += [f"all-reduce {b}" for b in range(len(buckets))]
        ax.set_yticks(ticks, labels, fontsize=10)
        ax.tick_params(axis="x", labelsize=10)
        many = "one bucket" if len(buckets) == 1 else f"{len(buckets)} buckets"
        ax.set_title(f"step {s + 1}: {many}", fontsize=11)
    axes[-1].set_xlabel("ms since backward() was called", fontsize=10)
    handles: list[Any] = [
        Line2D(
            [],
            [],
            marker="o",
            linestyle="",
            color=colors(b % 10),
            label=f"gradient ready, bucket {b}",
        )
        for b in range(most)
    ]
    handles.append(Patch(color="0.6", label="a bucket's all-reduce, launch to done"))
    handles.append(Line2D([], [], color="black", linestyle="--", label="backward() returned"))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / fig.get_size_inches()[1], 1, 1))
    return fig
