"""`CollectiveGuard`: each collective checked against every rank's call before it runs (the
package's docstring says how)."""

from __future__ import annotations

import datetime
import os
import time
from array import array
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from refimpl._group_timeout import group_timeout
from refimpl.guard._buffers import CARRY_BYTES, ExchangeBuffers
from refimpl.guard._carry import carriable, reduce_in_rank_order
from refimpl.guard._exchange import RowExchange, connect
from refimpl.guard._fingerprint import FINGERPRINT_LEN, fingerprint, reduce_code
from refimpl.guard._report import Where, mismatch_report, timeout_report

__all__ = ["CARRY_BYTES", "CollectiveGuard"]

_CARRY_MAX_WORLD = 64  # past this, gathering every rank's copy costs more than it saves
_CACHED_FINGERPRINTS = 1024  # kinds of call (op, name, dtype, shape) kept ready per guard
_SUM = dist.ReduceOp.SUM
assert reduce_code(_SUM) == 0  # all_reduce's fast path for the default op


class CollectiveGuard:
    """Named collectives that raise `CollectiveMismatch` on every rank when ranks disagree.

    ``group``: the process group the collectives run in (default: WORLD). The fingerprints
    travel over Unix datagram sockets when every rank of ``group`` is on this host and
    ``host_exchange`` is True (the default), else in a gloo group of their own (host-side even
    when the training collectives are NCCL); either way they wait ``timeout_s``, by default
    ``group``'s own timeout: a shorter one would kill a healthy job whose rank 0 works alone
    (saves, evaluates) for longer than it, where the group itself would have waited.
    ``host_exchange=False`` keeps the gloo all-gather on one host too. Creating a guard is a
    collective: build it on every rank at start-up. ``enabled=False`` (or ``REFIMPL_GUARD=0``
    in the environment) makes every method a plain collective: the off switch for a run that
    has been checked.

    Every rank must route the same collectives through the guard; a collective made outside
    it is invisible to it and shows up as the *next* guarded call timing out.
    """

    _created = 0

    def __init__(
        self,
        group: Any = None,
        *,
        enabled: bool = True,
        timeout_s: float | None = None,
        host_exchange: bool = True,
    ) -> None:
        self.enabled = enabled and os.environ.get("REFIMPL_GUARD", "1") != "0"
        self.group = group
        if timeout_s is None and dist.is_initialized():
            timeout_s = (group_timeout(group) or dist.default_pg_timeout).total_seconds()
        self.timeout_s = 60.0 if timeout_s is None else timeout_s
        self.seq = 0
        self._check_group: Any = None
        self._store: Any = None
        self._world: int | None = None  # set with the check group (or at the first check)
        self._me = 0
        self._buffers = ExchangeBuffers()
        self._pg: Any = None  # the check group's ProcessGroup object
        self._want_host = host_exchange
        self._rows: RowExchange | None = None  # the exchange path, chosen by _join
        self._fingerprints: dict[Any, array[int]] = {}
        self._last_passed: array[int] | None = None  # the last call every rank agreed on
        # Guards are created in the same order on every rank (creation is collective), so a
        # per-process count names the same guard everywhere: the store key for last calls.
        CollectiveGuard._created += 1
        self._key = f"refimpl_guard/{CollectiveGuard._created}"
        if self.enabled and dist.is_initialized():
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self._check_group = dist.new_group(
                ranks, backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
            )
            try:  # the store is where a rank leaves its last call for a timeout report
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:  # pragma: no cover - no default store (custom init)
                self._store = None
            self._join()

    def check(
        self, op: str, name: str, tensor: torch.Tensor | None = None, detail: int = 0
    ) -> None:
        """Compare this call with every rank's; raise `CollectiveMismatch` if they differ."""
        if self.enabled and dist.is_initialized():
            self._exchange(op, name, tensor, detail)

    def _exchange(
        self,
        op: str,
        name: str,
        tensor: torch.Tensor | None,
        detail: int,
        carry: np.ndarray[Any, Any] | None = None,
    ) -> None:
        """Every rank gets every rank's fingerprint (and ``carry``'s bytes after it)."""
        # None: the process group appeared after the guard was built
        world = self._world if self._world is not None else self._join()
        buffers = self._buffers
        fp = buffers.own_row
        fp[:FINGERPRINT_LEN] = self._static_part(op, name, tensor, detail)
        fp[1] = self.seq
        self.seq += 1
        if carry is not None:
            buffers.put_carry(carry)
        rows = self._rows
        assert rows is not None  # set by _join
        arrived, started = time.time(), time.monotonic()
        # One exchange of a fixed-size row: every rank gets every rank's call at once, so
        # agreeing costs one exchange and disagreeing needs no second one.
        try:
            rows.exchange(buffers, self.timeout_s)
        except RuntimeError as exc:
            rows.withdraw()
            failed_after = time.monotonic() - started
            passed = None if self._last_passed is None else self._last_passed.tolist()
            where = Where(self._me, world, self._store, self._key, self.timeout_s, passed)
            head = fp[:FINGERPRINT_LEN].tolist()
            raise timeout_report(where, head, exc, arrived, failed_after) from exc
        if buffers.all_heads_equal_own():  # every rank's call is mine
            self._last_passed = fp[:FINGERPRINT_LEN]
            return
        raise mismatch_report(self._me, [h.tolist() for h in buffers.gathered_heads])

    def _join(self) -> int:
        """Size the buffer that receives every rank's row and pick the exchange path, once
        the group exists."""
        self._pg = self._check_group or dist.distributed_c10d._get_default_group()
        world = self._world = dist.get_world_size(self._check_group)
        self._me = dist.get_rank(self._check_group)
        self._buffers.resize(world)
        if self._rows is not None:
            self._rows.close()
        self._rows = connect(self._check_group, self._pg, host_exchange=self._want_host)
        return world

    def _carried(self, tensor: torch.Tensor, code: int) -> bool:
        """Whether this all-reduce can travel inside the exchange. Decided from what the
        fingerprint holds (op, reduce op, dtype, device, shape) and the world size, so ranks
        whose fingerprints agree always decide alike."""
        world = self._world if self._world is not None else self._join()
        return (
            tensor.nbytes <= CARRY_BYTES and world <= _CARRY_MAX_WORLD and carriable(tensor, code)
        )

    def _reduce_carried(
        self, tensor: torch.Tensor, values: np.ndarray[Any, Any], code: int
    ) -> None:
        """Reduce every rank's carried copy of ``tensor`` (whose numpy view is ``values``) into
        it, in rank order: element-wise ops, so every rank does the same arithmetic and gets
        the same bits."""
        copies = self._buffers.typed_carries(values.dtype, values.nbytes)
        reduce_in_rank_order(copies, values, tensor, code)

    def _static_part(
        self, op: str, name: str, tensor: torch.Tensor | None, detail: int
    ) -> array[int]:
        """The call's fingerprint with sequence number 0, built once per kind of call."""
        kind = None
        if tensor is not None:
            kind = (tensor.dtype, "cpu" if tensor.is_cpu else tensor.device.type, tensor.shape)
        key = (op, name, detail, kind)
        fp = self._fingerprints.get(key)
        if fp is None:
            if len(self._fingerprints) >= _CACHED_FINGERPRINTS:
                self._fingerprints.clear()
            fp = array("q", fingerprint(0, op, name, tensor, detail))
            self._fingerprints[key] = fp
        return fp

    def all_reduce(self, tensor: torch.Tensor, *, name: str, op: Any = dist.ReduceOp.SUM) -> None:
        """``dist.all_reduce(tensor, op)`` in ``group``, after checking every rank agrees.

        A CPU tensor of up to `CARRY_BYTES` (a metric's sum and count) reduced with SUM,
        PRODUCT, MIN or MAX travels inside the check: every rank gathers every rank's copy with
        its fingerprint and, if all fingerprints agree, reduces the copies itself in rank order.
        The guarded call is then one all-gather, not a check and an all-reduce. The result is
        the same on every rank; with more than two ranks a float sum may differ from gloo's
        ring order in the last bit. Larger tensors: the check, then ``dist.all_reduce`` (in
        the guard's group for a CPU tensor: see `data_group`)."""
        code = 0 if op is _SUM else reduce_code(op)
        if not self.enabled or not dist.is_initialized():
            dist.all_reduce(tensor, op=op, group=self.group)
        elif self._carried(tensor, code):
            values = tensor.detach().numpy() if tensor.requires_grad else tensor.numpy()
            self._exchange("all_reduce", name, tensor, code, carry=values)
            self._reduce_carried(tensor, values, code)
        else:
            self._exchange("all_reduce", name, tensor, code)
            dist.all_reduce(tensor, op=op, group=self.data_group(tensor))

    def broadcast(self, tensor: torch.Tensor, src: int, *, name: str) -> None:
        """``dist.broadcast(tensor, src)`` in ``group``, after checking every rank agrees."""
        self.check("broadcast", name, tensor, src)
        dist.broadcast(tensor, src=src, group=self.data_group(tensor))

    def all_gather(self, tensors: list[torch.Tensor], tensor: torch.Tensor, *, name: str) -> None:
        """``dist.all_gather(tensors, tensor)`` in ``group``, after checking every rank agrees."""
        self.check("all_gather", name, tensor)
        dist.all_gather(tensors, tensor, group=self.data_group(tensor, *tensors))

    def data_group(self, *tensors: torch.Tensor) -> Any:
        """Where a guarded call's data goes once the check has passed: the guard's own gloo
        group (same ranks as ``group``, timeout ``timeout_s``) when every tensor is on the CPU,
        else ``group``. Why: right after the check, the guard's group is ready to run the next
        collective, where switching to another group costs a wake-up. Collectives made
        outside the guard stay in ``group``, so they never pair with a guarded call."""
        if self._check_group is not None and all(t.is_cpu for t in tensors):
            return self._check_group
        return self.group

    def barrier(self, *, name: str) -> None:
        """A barrier that also checks every rank is at the same named point."""
        self.check("barrier", name)
        if not self.enabled:
            dist.barrier(group=self.group)
