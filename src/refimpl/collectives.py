"""Chapter 1: processes, ranks and collectives, shown on a few gloo processes.

Every function whose docstring starts with "Worker:" runs inside the ranks that
`refimpl.launch.spawn` starts; the others are plain helpers. Workers return their
results instead of printing, so the notebook prints them once, in rank order.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from refimpl.device import rank_device
from refimpl.launch import RankInfo, init_from_env

__all__ = [
    "global_rank",
    "main",
    "plot_ring_steps",
    "raise_on_rank",
    "rank_info",
    "rank_table",
    "ring_all_reduce",
    "ring_matches_builtin",
    "ring_snapshots",
    "sampler_shards",
    "show_collectives",
    "time_all_reduce",
]


def rank_info() -> RankInfo:
    """Worker: report where this process sits (rank, local rank, world size, backend)."""
    return init_from_env()


def global_rank(node_rank: int, local_rank: int, nproc_per_node: int) -> int:
    """The global rank torchrun gives to process ``local_rank`` on node ``node_rank``.

    torchrun numbers processes node by node: ``node_rank * nproc_per_node + local_rank``.
    """
    if not 0 <= local_rank < nproc_per_node:
        raise ValueError(f"local_rank {local_rank} is outside 0..{nproc_per_node - 1}")
    return node_rank * nproc_per_node + local_rank


def rank_table(nnodes: int, nproc_per_node: int) -> list[tuple[int, int, int]]:
    """``(node_rank, local_rank, global_rank)`` for every process of a job."""
    return [
        (node, local, global_rank(node, local, nproc_per_node))
        for node in range(nnodes)
        for local in range(nproc_per_node)
    ]


def show_collectives() -> dict[str, Any]:
    """Worker: run the four collectives on tiny tensors and return before/after values.

    Rank ``r`` starts from ``[10r, 10r+1, ...]`` so every number says where it came from.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    # rank_device(): the CPU under gloo, cuda:LOCAL_RANK under NCCL (which moves only GPU
    # tensors), so the same worker runs from the notebook and under torchrun on a GPU node.
    mine = torch.arange(world, dtype=torch.int64, device=rank_device()) + 10 * rank

    bcast = mine.clone()
    dist.broadcast(bcast, src=0)  # everyone gets rank 0's tensor

    summed = mine.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)  # everyone gets the elementwise sum

    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)  # everyone gets every rank's tensor

    piece = torch.empty(1, dtype=torch.int64, device=mine.device)
    dist.reduce_scatter(piece, list(mine.chunk(world)))  # rank r gets element r of the sum

    return {
        "rank": rank,
        "input": mine.tolist(),
        "broadcast": bcast.tolist(),
        "all_reduce": summed.tolist(),
        "all_gather": [t.tolist() for t in gathered],
        "reduce_scatter": piece.tolist(),
    }


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send to the right neighbour while receiving from the left one.

    Both calls are posted before either is waited on: if every rank did a blocking
    ``send`` first, each would wait for a ``recv`` that its neighbour has not posted yet.
    """
    requests = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, dst), dist.P2POp(dist.irecv, recv, src)]
    )
    for request in requests:
        request.wait()


def ring_all_reduce(
    tensor: torch.Tensor, snapshots: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place with a ring of send/recv, as NCCL does.

    The tensor is cut into ``world_size`` chunks. In ``world_size - 1`` reduce-scatter steps
    each rank passes one chunk to its right neighbour, which adds it to its own copy; after
    them rank ``r`` holds the full sum of chunk ``(r + 1) % world_size``. In ``world_size - 1``
    all-gather steps the finished chunks travel round the ring once more. Each rank sends
    ``2 (N - 1) / N`` times the tensor's size in total, whatever ``N`` is. If ``snapshots``
    is a list, a copy of the tensor is appended after every step (for drawing the ring).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return tensor
    right, left = (rank + 1) % world, (rank - 1) % world
    flat = tensor.view(-1)
    chunks = list(torch.tensor_split(flat, world))
    for step in range(world - 1):  # reduce-scatter: accumulate partial sums
        send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv_idx])
        _exchange(chunks[send_idx].clone(), right, incoming, left)
        chunks[recv_idx] += incoming
        if snapshots is not None:
            snapshots.append(tensor.clone())
    for step in range(world - 1):  # all-gather: circulate the finished chunks
        send_idx, recv_idx = (rank + 1 - step) % world, (rank - step) % world
        incoming = torch.empty_like(chunks[recv_idx])
        _exchange(chunks[send_idx].clone(), right, incoming, left)
        chunks[recv_idx].copy_(incoming)
        if snapshots is not None:
            snapshots.append(tensor.clone())
    return tensor


def ring_matches_builtin(numel: int, seed: int = 0) -> dict[str, Any]:
    """Worker: compare `ring_all_reduce` with ``dist.all_reduce`` on the same random data.

    Integers must match exactly. Floats may differ in the last bits, because addition is
    not associative and the two add the ranks' values in different orders.
    """
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed + rank)
    device = rank_device()
    ints = torch.randint(-1000, 1000, (numel,), generator=gen).to(device)
    floats = torch.randn(numel, generator=gen).to(device)
    out: dict[str, Any] = {"rank": rank}
    for name, data in (("int64", ints), ("float32", floats)):
        ours, theirs = ring_all_reduce(data.clone()), data.clone()
        dist.all_reduce(theirs)
        out[f"{name}_max_abs_diff"] = (ours - theirs).abs().max().item()
        out[f"{name}_equal"] = torch.equal(ours, theirs)
    return out


def ring_snapshots() -> list[list[int]]:
    """Worker: run the ring on ``[2**rank] * world_size`` and return the tensor after each step.

    Each value is a bitmask of the ranks whose contribution it contains (bit ``r`` set =
    rank ``r``'s number is in the sum), which is what the chapter's ring figure draws.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = torch.full((world,), 2**rank, dtype=torch.int64, device=rank_device())
    steps = [tensor.clone()]
    ring_all_reduce(tensor, snapshots=steps)
    return [s.tolist() for s in steps]


def time_all_reduce(sizes: list[int], repeats: int = 7) -> dict[int, float]:
    """Worker: median seconds of one float32 ``all_reduce`` for each element count.

    Every repeat starts from a barrier, so ranks enter the collective together and the
    time is the collective's, not the wait for a late rank.
    """
    medians: dict[int, float] = {}
    for numel in sizes:
        tensor = torch.ones(numel, device=rank_device())
        dist.all_reduce(tensor)  # warm-up: first use sets up buffers and connections
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            samples.append(time.perf_counter() - start)
        samples.sort()
        medians[numel] = samples[len(samples) // 2]
    return medians


def sampler_shards(dataset_len: int, batch_size: int, seed: int = 0) -> dict[str, Any]:
    """Worker: which samples ``DistributedSampler`` gives this rank, and steps per epoch.

    ``batch_size`` is per process, as in a DataLoader on each rank: the global batch is
    ``batch_size * world_size``, so an epoch takes ``world_size`` times fewer steps.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = cast("Dataset[int]", range(dataset_len))  # the sampler only needs len()
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed
    )
    sampler.set_epoch(0)
    indices = list(sampler)
    return {
        "rank": rank,
        "indices": indices,
        "steps_per_epoch": -(-len(indices) // batch_size),
        "global_batch": batch_size * world,
    }


def plot_ring_steps(per_rank: list[list[list[int]]]) -> Any:
    """Draw `ring_snapshots` results: ranks as rows, chunks as columns, one panel per step.

    The top row is the start and the reduce-scatter steps, the bottom row the all-gather
    steps and a key. A cell's shade is how many ranks' numbers the chunk contains there, its
    label lists them ("013": ranks 0, 1 and 3, "all" once every rank's is in), and an
    outline marks the chunks that changed in that step. Sized for a page about 780 px wide,
    so the labels stay at 10 pt. Returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    world = len(per_rank)
    n_steps = len(per_rank[0])
    fig, grid = plt.subplots(2, world, figsize=(7.8, 4.8), squeeze=False)
    panels = [grid[0, c] for c in range(world)] + [grid[1, c] for c in range(world - 1)]
    for step, ax in enumerate(panels[:n_steps]):
        values = [per_rank[r][step] for r in range(world)]
        shade = [[bin(v).count("1") for v in row] for row in values]
        ax.imshow(shade, cmap="Blues", vmin=0, vmax=world + 1)
        for r in range(world):
            for c in range(world):
                who = [str(k) for k in range(world) if values[r][c] >> k & 1]
                full = len(who) == world
                ax.text(
                    c,
                    r,
                    "all" if full else "".join(who),
                    ha="center",
                    va="center",
                    fontsize=10,
                    color="white" if full else "black",
                )
                if step and values[r][c] != per_rank[r][step - 1][c]:
                    ax.add_patch(
                        Rectangle(
                            (c - 0.45, r - 0.45),
                            0.9,
                            0.9,
                            fill=False,
                            edgecolor="tab:orange",
                            linewidth=2.5,
                        )
                    )
        if step == 0:
            title = "start"
        elif step < world:
            title = f"reduce-scatter {step}"
        else:
            title = f"all-gather {step - world + 1}"
        ax.set_title(title, fontsize=11)
        ax.set_xticks(range(world), [f"c{c}" for c in range(world)], fontsize=10)
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)], fontsize=10)
        ax.tick_params(length=0)
        if ax not in (grid[0, 0], grid[1, 0]):
            ax.set_yticklabels([])
    key = grid[1, world - 1]
    key.axis("off")
    key.text(
        0.0,
        0.5,
        "rows: ranks\ncolumns: chunks\n\nlabel: the ranks whose\nnumbers it holds\n"
        "(01: ranks 0 and 1)\n\norange: changed\nin this step\n\n"
        "each step, rank r\nsends one chunk\nto rank r+1",
        fontsize=10,
        va="center",
        transform=key.transAxes,
    )
    fig.tight_layout(h_pad=1.5)
    return fig


def raise_on_rank(bad_rank: int) -> int:
    """Worker: rank ``bad_rank`` raises; the others wait in a barrier it never reaches."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"bad input on rank {bad_rank}")
    dist.barrier()
    return dist.get_rank()


def main(argv: list[str] | None = None) -> None:
    """``python -m refimpl.collectives``: the chapter's checks, on 2 local ranks or under torchrun.

    Under torchrun (``RANK`` is set) every process joins the job's group and rank 0 prints;
    run plainly, it starts 2 gloo ranks with `refimpl.launch.spawn`. It takes no options:
    ``--help`` prints this and exits 0, any other argument exits 2 (argparse), so a typo
    never starts ranks.
    """
    import argparse
    import os

    from refimpl.launch import spawn

    argparse.ArgumentParser(
        prog="python -m refimpl.collectives",
        description="Chapter 1's collectives and ring all-reduce check, on 2 local gloo ranks "
        "(or on every rank of a torchrun job, where rank 0 prints).",
    ).parse_args(argv)
    if "RANK" in os.environ:
        info = init_from_env()
        views, ring = [show_collectives()], [ring_matches_builtin(1 << 20)]
        if info.rank != 0:
            return
        print(f"world size {info.world_size}, backend {info.backend}")
    else:
        views, ring = spawn(show_collectives, 2), spawn(ring_matches_builtin, 2, 1 << 20)
    for view in views:
        print(view)
    for check in ring:
        print(check)


if __name__ == "__main__":
    main()
