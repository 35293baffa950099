"""Which device this rank's tensors belong on: the one rule every worker and collective uses.

NCCL only moves CUDA tensors and gloo is happiest with CPU ones, so a worker that builds its
tensors with ``torch.zeros(n)`` runs under `refimpl.launch.spawn` (gloo) and fails on a GPU
node under ``torchrun`` (NCCL): "No backend type associated with device type cpu". Building
every tensor on `rank_device()` makes the same worker run on both.

The rule, as torchrun lays processes out: under a backend that drives CUDA (``nccl``, or a
``"cpu:gloo,cuda:nccl"`` pair) rank ``r`` owns ``cuda:LOCAL_RANK``; under gloo, the CPU.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["backend_uses_cuda", "rank_device"]


def backend_uses_cuda(backend: str) -> bool:
    """True when ``backend`` (a name such as ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``) runs CUDA
    collectives, so tensors passed to its collectives must live on a GPU."""
    name = backend.lower()
    return "nccl" in name or "cuda:" in name


def rank_device(backend: str | None = None) -> torch.device:
    """The device this rank's tensors and collectives should use.

    ``backend`` defaults to the initialised process group's backend, or, with no group, to
    ``"nccl"`` when a GPU is present and ``"gloo"`` otherwise (what `refimpl.launch.init_from_env`
    picks). A CUDA backend gives ``cuda:LOCAL_RANK`` (``LOCAL_RANK`` as torchrun and `spawn` set
    it, 0 when unset); anything else gives the CPU. Raises `RuntimeError` naming the rank when a
    CUDA backend is asked for on a machine without enough GPUs.

    Example::

        x = torch.ones(4, device=rank_device())
        dist.all_reduce(x)  # gloo on a laptop, NCCL on a GPU node: the same line
    """
    if backend is None:
        if dist.is_available() and dist.is_initialized():
            backend = str(dist.get_backend())
        else:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not backend_uses_cuda(backend):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count:
        raise RuntimeError(
            f"rank with LOCAL_RANK={local_rank}: backend {backend!r} needs a GPU per local rank "
            f"but this machine has {count}. Start at most {count} processes per node "
            "(torchrun --nproc-per-node), or use backend='gloo' to run on the CPU."
        )
    return torch.device("cuda", local_rank)
