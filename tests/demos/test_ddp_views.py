"""refimpl.demos.ddp_views: chapter 2's hook-trace figure and the compact bucket notation."""

from __future__ import annotations

import matplotlib.pyplot as plt

from refimpl.demos.ddp_views import compact, plot_hook_trace


def test_compact_writes_buckets_as_indices_separated_by_bars() -> None:
    assert compact([[5, 4, 3, 2], [1, 0]]) == "5432|10"
    assert compact([[0, 1, 2, 3, 4, 5]]) == "012345"
    assert compact([[11, 10], [9, 0]]) == "11,10|9,0"  # unambiguous past 9


def _trace() -> dict:
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]

    def step(buckets: list[list[int]], launches: list[float]) -> dict:
        grads = [(0.004, "grad", 3), (0.005, "grad", 2), (0.008, "grad", 1), (0.009, "grad", 0)]
        comm = [(t, "launch", b) for b, t in enumerate(launches)]
        comm += [(t + 0.003, "done", b) for b, t in enumerate(launches)]
        return {"events": sorted(grads + comm), "buckets": buckets, "backward_returned": 0.014}

    one = step([[0, 1, 2, 3]], [0.0095])
    two = step([[3, 2], [1, 0]], [0.0055, 0.0095])
    return {"names": names, "steps": [one, one, two]}


def test_hook_trace_figure_stacks_steps_with_a_bucket_legend_and_10_pt_text() -> None:
    fig = plot_hook_trace(_trace(), steps=(0, 2))
    try:
        assert fig.get_size_inches()[0] <= 7.8  # the book's page is about 780 px wide
        top, bottom = fig.axes
        assert top.get_position().y0 > bottom.get_position().y1  # stacked, not side by side
        assert [t.get_text() for t in bottom.get_yticklabels()] == [
            "layer 0",
            "layer 2",
            "all-reduce 0",
            "all-reduce 1",
        ]
        legend = fig.legends[0]
        entries = [t.get_text() for t in legend.get_texts()]
        assert entries[:2] == ["gradient ready, bucket 0", "gradient ready, bucket 1"]
        assert "backward() returned" in entries
        texts = [*legend.get_texts(), top.title, bottom.xaxis.label]
        for ax in fig.axes:
            texts += [*ax.get_yticklabels(), *ax.get_xticklabels()]
        assert min(t.get_fontsize() for t in texts) >= 10
        # Step 3's dots come in two colours, one per bucket.
        dots = {str(line.get_color()) for line in bottom.lines if line.get_marker() == "o"}
        assert len(dots) == 2
    finally:
        plt.close(fig)
