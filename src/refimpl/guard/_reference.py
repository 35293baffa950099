"""`ReferenceGuard`: the guard's plain version, to read first and to check `CollectiveGuard`
against. Each guarded call builds its fingerprint, all-gathers it in a gloo group of the
guard's own, and compares; nothing is cached, carried or exchanged another way."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from refimpl._group_timeout import group_timeout
from refimpl.guard._fingerprint import decode, fingerprint, reduce_code
from refimpl.guard._report import CollectiveMismatch, mismatch_report

__all__ = ["ReferenceGuard"]


class ReferenceGuard:
    """Named collectives that raise `CollectiveMismatch` on every rank when ranks disagree:
    the same verdict, and the same message, as `CollectiveGuard` for the same calls.

    One ``dist.all_gather`` of the fingerprint per call, in a gloo group of the guard's own
    (same ranks as ``group``, timeout ``timeout_s``, by default ``group``'s), then the
    collective itself in ``group``. When not every rank comes within ``timeout_s`` it raises
    `CollectiveMismatch` naming this rank's call, without `CollectiveGuard`'s report of each
    peer's last call. Creating it is a collective: build it on every rank at start-up. Why it
    exists: it is the definition the fast guard must agree with."""

    def __init__(self, group: Any = None, *, timeout_s: float | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ReferenceGuard: init_process_group first (creating it is a collective)"
            )
        if timeout_s is None:
            timeout_s = (group_timeout(group) or dist.default_pg_timeout).total_seconds()
        self.group = group
        self.timeout_s = timeout_s
        self.seq = 0
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self._check_group = dist.new_group(
            ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )

    def check(
        self, op: str, name: str, tensor: torch.Tensor | None = None, detail: int = 0
    ) -> None:
        """Compare this call with every rank's; raise `CollectiveMismatch` if they differ or
        not every rank reaches it within ``timeout_s``."""
        mine = torch.tensor(fingerprint(self.seq, op, name, tensor, detail), dtype=torch.int64)
        self.seq += 1
        me = dist.get_rank(self._check_group)
        world = dist.get_world_size(self._check_group)
        heads = [torch.empty_like(mine) for _ in range(world)]
        try:
            dist.all_gather(heads, mine, group=self._check_group)
        except RuntimeError as exc:
            call = decode(me, mine.tolist())
            calls: list[Any] = [None] * world
            calls[me] = call
            raise CollectiveMismatch(
                f"rank {me}: not every rank reached {call.op} {call.name!r} "
                f"(call #{call.seq}) within {self.timeout_s:g} s ({type(exc).__name__}). "
                "A rank that made fewer guarded calls, an unguarded collective, or a stuck "
                "rank does this.",
                calls,
            ) from exc
        if not all(torch.equal(head, mine) for head in heads):
            raise mismatch_report(me, [head.tolist() for head in heads])

    def all_reduce(self, tensor: torch.Tensor, *, name: str, op: Any = dist.ReduceOp.SUM) -> None:
        """``dist.all_reduce(tensor, op)`` in ``group``, after checking every rank agrees."""
        self.check("all_reduce", name, tensor, reduce_code(op))
        dist.all_reduce(tensor, op=op, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int, *, name: str) -> None:
        """``dist.broadcast(tensor, src)`` in ``group``, after checking every rank agrees."""
        self.check("broadcast", name, tensor, src)
        dist.broadcast(tensor, src=src, group=self.group)

    def all_gather(self, tensors: list[torch.Tensor], tensor: torch.Tensor, *, name: str) -> None:
        """``dist.all_gather(tensors, tensor)`` in ``group``, after checking every rank agrees."""
        self.check("all_gather", name, tensor)
        dist.all_gather(tensors, tensor, group=self.group)

    def barrier(self, *, name: str) -> None:
        """A barrier that also checks every rank is at the same named point (the check's
        all-gather is the barrier)."""
        self.check("barrier", name)
