"""Chapter 1's exercise (the ring all-reduce with blocking sends) and its device mesh.

`refimpl.collectives.ring_all_reduce` posts each step's send and receive together
(``dist.batch_isend_irecv``). `blocking_ring` runs the same ring with a plain
``dist.send`` and ``dist.recv`` in their place: every rank sending first, or even ranks
sending first and odd ranks receiving first. Run it under `refimpl.launch.spawn` with a
short ``pg_timeout_s`` so that a deadlock ends as a timeout.

`mesh_view` shows the ranks as a 2-D ``DeviceMesh`` and the process group along each of its
dimensions.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist

from refimpl import collectives
from refimpl.device import rank_device

__all__ = ["blocking_ring", "mesh_view"]

ORDERS = ("send first", "even ranks send first")


def _blocking_exchange(order: str) -> Callable[[torch.Tensor, int, torch.Tensor, int], None]:
    def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        if order == "send first" or dist.get_rank() % 2 == 0:
            dist.send(send, dst)
            dist.recv(recv, src)
        else:
            dist.recv(recv, src)
            dist.send(send, dst)

    return exchange


def blocking_ring(
    order: str = "send first", numel: int = 1000, hold_s: float = 1.0
) -> tuple[str, str]:
    """Worker: `ring_all_reduce` with its exchange made of blocking ``send``/``recv`` calls.

    ``order`` is ``"send first"`` (every rank sends, then receives) or ``"even ranks send
    first"`` (odd ranks receive first). Returns ``(outcome, message)``: ``("sum correct",
    "")`` when the ring's result equals ``dist.all_reduce``'s; ``("stuck until
    timeout", message)`` when this rank's send timed out or a peer whose send timed out
    closed the connection (which of the two a rank sees is a race); otherwise
    ``("error", message)``. The message is the error's first line without gloo's source
    location. After an error the rank stays alive ``hold_s`` seconds before it returns.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    data = torch.arange(numel, dtype=torch.int64, device=rank_device()) + dist.get_rank()
    with mock.patch.object(collectives, "_exchange", _blocking_exchange(order)):
        try:
            ours = collectives.ring_all_reduce(data.clone())
        except RuntimeError as exc:
            time.sleep(hold_s)
            message = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).splitlines()[0])
            stuck = message.startswith(("Timed out", "Connection closed by peer"))
            return ("stuck until timeout" if stuck else "error"), message
    dist.all_reduce(data)
    return ("sum correct" if torch.equal(ours, data) else "sum wrong"), ""


def mesh_view(shape: tuple[int, int] = (2, 2)) -> dict[str, object]:
    """Worker: arrange the world as a 2-D ``DeviceMesh`` named ("dp", "tp") of ``shape``.

    Returns this rank's coordinate in the mesh, the global ranks of the process group along
    each dimension (what ``mesh.get_group(name)`` hands to a collective), and the sum of the
    global ranks all-reduced in each of those groups.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(rank_device().type, shape, mesh_dim_names=("dp", "tp"))
    out: dict[str, object] = {"coordinate": mesh.get_coordinate()}
    for name in ("dp", "tp"):
        group = mesh.get_group(name)
        total = torch.tensor([dist.get_rank()], device=rank_device())
        dist.all_reduce(total, group=group)
        out[f"{name} group"] = dist.get_process_group_ranks(group)
        out[f"{name} sum"] = int(total.item())
    return out
