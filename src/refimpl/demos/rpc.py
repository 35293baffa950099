"""Appendix: ``torch.distributed.rpc`` in one page, run on two local processes.

Collectives (the rest of this book) make every rank call the same operation together. RPC is
the other half of ``torch.distributed``: one process asks a named other process to run a
function and send back the result, or keep it and hand out a reference (an ``RRef``). It is
what parameter servers and pipeline schedules built before FSDP were made of.

`rpc_tour` runs inside `refimpl.launch.spawn` (a gloo group already exists: it is used only
to agree on a port). Every function that crosses the wire is defined at module level here,
because RPC, like `spawn`, pickles functions by reference. `rpc_plumbing` shows what
``init_rpc`` builds underneath (a c10d store, a short-lived gloo group, TensorPipe listeners);
`late_shutdown` shows that a graceful ``rpc.shutdown()`` has no time limit by default.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.rpc import backend_registry

__all__ = ["Counter", "late_shutdown", "rpc_plumbing", "rpc_tour", "scaled_sum"]


class Counter:
    """A stateful object that lives on its owner; other workers reach it through an RRef."""

    def __init__(self, start: int) -> None:
        self.value = start

    def add(self, n: int) -> int:
        self.value += n
        return self.value


def scaled_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Runs on the callee: differentiable, so distributed autograd can flow back through it."""
    return (x * w).sum()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init_rpc(timeout_s: float) -> None:
    """init_rpc on every rank of the spawned group, with a fresh rendezvous address."""
    rank, world = dist.get_rank(), dist.get_world_size()
    port = [_free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)  # RPC needs its own rendezvous address
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port[0]}", rpc_timeout=timeout_s
    )
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options
    )


def rpc_tour(timeout_s: float = 20.0) -> list[str]:
    """Worker (2 ranks): worker0 calls worker1 synchronously, asynchronously, creates an
    object there and calls its method through an RRef, and runs a backward pass that crosses
    the process boundary. Returns what worker0 saw (worker1 returns an empty list)."""
    rank = dist.get_rank()
    _init_rpc(timeout_s)
    seen: list[str] = []
    try:
        if rank == 0:
            seen = _caller_side()
    finally:
        rpc.shutdown()  # waits for every worker's outstanding calls: a collective of RPC
    return seen


def _caller_side() -> list[str]:
    seen = []
    # rpc_sync: block until the callee's result is back.
    total = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    seen.append(f"rpc_sync(torch.add) -> {total.tolist()}")
    # rpc_async: a Future now, the value when you wait for it.
    fut = rpc.rpc_async("worker1", torch.mul, args=(torch.ones(2), 3))
    seen.append(f"rpc_async(torch.mul).wait() -> {fut.wait().tolist()}")
    # remote: the result stays on worker1; we get a reference to it.
    counter: Any = rpc.remote("worker1", Counter, args=(10,))
    seen.append(f"remote(Counter) -> RRef owned by {counter.owner().name}")
    seen.append(f"rref.rpc_sync().add(5) -> {counter.rpc_sync().add(5)}")
    seen.append(f"rref.rpc_sync().add(1) -> {counter.rpc_sync().add(1)} (state kept on worker1)")
    # Distributed autograd: the forward ran partly on worker1; backward follows it there.
    w = torch.tensor([2.0, 3.0], requires_grad=True)
    with dist_autograd.context() as ctx:
        loss = rpc.rpc_sync("worker1", scaled_sum, args=(torch.tensor([4.0, 5.0]), w))
        dist_autograd.backward(ctx, [loss])  # type: ignore[attr-defined]
        grad = dist_autograd.get_gradients(ctx)[w]  # type: ignore[attr-defined]
    seen.append(f"dist_autograd: loss {loss.item():g}, d loss / d w = {grad.tolist()}")
    return seen


def rpc_plumbing(timeout_s: float = 20.0) -> list[str]:
    """Worker (2 ranks): what ``init_rpc`` with the TensorPipe backend builds underneath.

    It records the keys of the c10d store that ``init_method`` rendezvoused through, once
    right after the backend's gloo group was created (by wrapping torch's private
    ``backend_registry._init_process_group``, restored afterwards) and once after the agent
    started; then whether anything but this check still references that gloo group. Returns
    worker0's report, ports replaced by ``<port>`` (worker1 returns an empty list)."""
    made: list[Any] = []
    keys_then: list[str] = []
    real: Any = backend_registry._init_process_group

    def spy(store: Any, group_rank: int, world_size: int) -> Any:
        group = real(store, group_rank, world_size)
        made.append(group)
        keys_then.extend(_store_keys(store))
        return group

    backend_registry._init_process_group = spy
    try:
        _init_rpc(timeout_s)
    finally:
        backend_registry._init_process_group = real
    seen: list[str] = []
    try:
        if dist.get_rank() == 0:
            agent: Any = rpc.api._get_current_rpc_agent()  # type: ignore[attr-defined]
            store = agent.store
            added = [k for k in _store_keys(store) if k not in keys_then]
            address = store.get("addrs/worker1").decode().rsplit(":", 1)[0]
            answer = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
            seen = [
                f"agent: {type(agent).__name__}; its store: {type(store).__name__} over the "
                f"{type(store.underlying_store).__name__} of init_method",
                f"store keys once the gloo group existed: {', '.join(keys_then)}",
                f"keys the agent added: {', '.join(added)}",
                f"addrs/worker1 = {address}:<port> (a TensorPipe listener)",
                f"gloo groups init_rpc made: {[type(g).__name__ for g in made]}",
                f"still referenced by torch once init_rpc returned: {sys.getrefcount(made[0]) > 2}",
                f"rpc_sync(torch.add) -> {answer.tolist()}",
            ]
    finally:
        rpc.shutdown()
    return seen


def _store_keys(store: Any) -> list[str]:
    """The keys init_rpc's PrefixStore ("rpc_prefix_N/") holds, without that prefix."""
    keys = store.underlying_store.list_keys()
    return sorted(k.split("/", 1)[1] for k in keys if k.startswith("rpc_prefix_"))


def late_shutdown(late_s: float, timeout_s: float = 2.0) -> list[str]:
    """Worker (2 ranks): worker1 reaches ``rpc.shutdown()`` ``late_s`` seconds after worker0,
    under ``rpc_timeout=timeout_s``. Returns worker0's report: whether its graceful shutdown
    returned normally, and whether it waited for worker1 past the RPC timeout."""
    rank = dist.get_rank()
    _init_rpc(timeout_s)
    if rank == 1:
        time.sleep(late_s)
    start = time.monotonic()
    rpc.shutdown()  # default: graceful, timeout=0 ("no timeout")
    waited = time.monotonic() - start
    if rank:
        return []
    return [
        f"worker1 reached rpc.shutdown() {late_s:g} s late, rpc_timeout={timeout_s:g} s:",
        f"worker0's shutdown returned normally, after waiting past the RPC timeout: "
        f"{waited > timeout_s and waited >= 0.8 * late_s}",
    ]
