"""Chapter 1's collectives: the ring all-reduce against gloo's, the rank arithmetic, sharding."""

from __future__ import annotations

import pytest

from refimpl import collectives as C
from refimpl.launch import spawn


def test_rank_table_for_two_nodes_of_eight() -> None:
    table = C.rank_table(2, 8)
    assert len(table) == 16
    assert table[0] == (0, 0, 0) and table[8] == (1, 0, 8) and table[-1] == (1, 7, 15)
    assert sorted(g for _, _, g in table) == list(range(16))


def test_global_rank_rejects_local_rank_outside_node() -> None:
    with pytest.raises(ValueError, match=r"outside 0\.\.7"):
        C.global_rank(0, 8, 8)


def test_collectives_on_three_ranks() -> None:
    views = spawn(C.show_collectives, 3)
    inputs = [v["input"] for v in views]
    assert inputs == [[0, 1, 2], [10, 11, 12], [20, 21, 22]]
    column_sums = [sum(col) for col in zip(*inputs, strict=True)]
    for rank, v in enumerate(views):
        assert v["broadcast"] == inputs[0]
        assert v["all_reduce"] == column_sums
        assert v["all_gather"] == inputs
        assert v["reduce_scatter"] == [column_sums[rank]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [1, 7, 1000])
def test_ring_all_reduce_equals_dist_all_reduce(world_size: int, numel: int) -> None:
    # numel=1 with 4 ranks leaves some chunks empty: the ring must still work.
    for out in spawn(C.ring_matches_builtin, world_size, numel, 123):
        assert out["int64_equal"], out  # integer sums do not depend on the order
        # float32 sums of 4 standard normals: the order changes only the last bits.
        assert out["float32_max_abs_diff"] < 1e-5, out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_snapshots_end_with_every_rank_in_every_chunk(world_size: int) -> None:
    per_rank = spawn(C.ring_snapshots, world_size)
    everyone = 2**world_size - 1
    for rank, steps in enumerate(per_rank):
        assert len(steps) == 1 + 2 * (world_size - 1)
        assert steps[0] == [2**rank] * world_size
        # After reduce-scatter, rank r owns the complete chunk (r + 1) % N ...
        assert steps[world_size - 1][(rank + 1) % world_size] == everyone
        # ... and after all-gather every chunk is complete on every rank.
        assert steps[-1] == [everyone] * world_size


def test_time_all_reduce_reports_each_size() -> None:
    sizes = [1, 1000]
    medians = spawn(C.time_all_reduce, 2, sizes, 3)
    for m in medians:
        assert sorted(m) == sizes and all(t > 0 for t in m.values())


def test_sampler_shards_cover_dataset_and_pad_to_equal_length() -> None:
    shards = spawn(C.sampler_shards, 4, 10, 2)
    indices = [s["indices"] for s in shards]
    assert all(len(i) == 3 for i in indices)  # ceil(10 / 4)
    flat = [i for shard in indices for i in shard]
    assert sorted(set(flat)) == list(range(10))
    assert len(flat) - len(set(flat)) == 2  # two samples repeated to even the shards
    assert all(s["global_batch"] == 8 and s["steps_per_epoch"] == 2 for s in shards)


@pytest.mark.slow
def test_module_runs_from_the_shell() -> None:
    """`python -m refimpl.collectives` spawns its own workers (they live in __main__ there)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "refimpl.collectives"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "'all_reduce': [10, 12]" in out
    assert out.count("'int64_equal': True") == 2


def test_ring_figure_has_two_rows_of_panels_with_labels_of_at_least_10_pt() -> None:
    import matplotlib.pyplot as plt

    per_rank = spawn(C.ring_snapshots, 4)
    fig = C.plot_ring_steps(per_rank)
    try:
        assert fig.get_size_inches()[0] <= 7.8  # the book's page is about 780 px wide
        panels = [ax for ax in fig.axes if ax.images]
        assert len(panels) == 7
        assert len({round(ax.get_position().y0, 2) for ax in panels}) == 2
        labels = [t.get_text() for t in panels[3].texts]
        assert labels.count("all") == 4  # end of reduce-scatter: one finished chunk per rank
        sizes = [t.get_fontsize() for ax in fig.axes for t in ax.texts]
        sizes += [t.get_fontsize() for ax in panels for t in ax.get_xticklabels()]
        assert min(sizes) >= 10
    finally:
        plt.close(fig)


def test_a_ring_of_blocking_sends_is_stuck_and_ordering_by_parity_fixes_it() -> None:
    from refimpl.demos.collectives import blocking_ring

    stuck = spawn(blocking_ring, 3, "send first", timeout_s=60, pg_timeout_s=2)
    assert all(outcome == "stuck until timeout" for outcome, _ in stuck), stuck
    assert any(m == "Timed out waiting 2000ms for send operation to complete" for _, m in stuck)
    fixed = spawn(blocking_ring, 3, "even ranks send first", timeout_s=60, pg_timeout_s=2)
    assert fixed == [("sum correct", "")] * 3
    with pytest.raises(ValueError, match="order must be one of"):
        blocking_ring("recv first")


def test_a_2x2_mesh_groups_rows_and_columns() -> None:
    from refimpl.demos.collectives import mesh_view

    views = spawn(mesh_view, 4)
    for rank, view in enumerate(views):
        row, col = divmod(rank, 2)
        assert view["coordinate"] == (row, col)
        assert view["tp group"] == [2 * row, 2 * row + 1] and view["tp sum"] == 4 * row + 1
        assert view["dp group"] == [col, col + 2] and view["dp sum"] == 2 * col + 2
