"""`refimpl.guard`'s exchange buffers in one object: this rank's row and the rows gathered from
every rank, each one int64 array seen through the bytes, numpy and torch views the exchange
paths and the checks read, so the hot path builds no tensors. Each name says which buffer."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import torch

from refimpl.guard._fingerprint import FINGERPRINT_LEN

__all__ = ["CARRY_BYTES", "ROW", "ExchangeBuffers"]

CARRY_BYTES = 256
"""A guarded all-reduce of a CPU tensor up to this size travels inside the fingerprint
exchange itself (see `CollectiveGuard.all_reduce`)."""
ROW = FINGERPRINT_LEN + CARRY_BYTES // 8
"""int64 slots each rank contributes per exchange: its fingerprint, then room for a carried
tensor."""


class ExchangeBuffers:
    """This rank's row (``own_*``) and every rank's row (``gathered_*``, rank r at index r).

    ``own_*`` exist from construction; ``gathered_*`` are sized by `resize` once the world
    size is known (empty before). Every view shares its array's memory: writing ``own_row``
    changes ``own_row_tensor`` and ``own_row_bytes``, and an exchange that fills
    ``gathered_row_tensors`` (or ``gathered_row_bytes``) is what ``gathered_heads`` and
    ``gathered_carries`` then read."""

    def __init__(self) -> None:
        self.own_row = array("q", bytes(8 * ROW))
        self.own_row_tensor = torch.frombuffer(self.own_row, dtype=torch.int64)
        self.own_row_bytes = memoryview(self.own_row).cast("B")
        self.own_head_bytes = self.own_row_bytes[: FINGERPRINT_LEN * 8]  # the fingerprint
        own = np.frombuffer(self.own_row, dtype=np.int64)
        self.own_carry = own[FINGERPRINT_LEN:].view(np.uint8)  # the carried tensor's bytes
        self.world = 0
        self.gathered_rows = array("q")
        self.gathered_row_tensors: list[torch.Tensor] = []  # what gloo's all-gather fills
        self.gathered_row_bytes: list[memoryview] = []  # what the host exchange fills
        self.gathered_head_bytes: list[memoryview] = []  # each rank's fingerprint
        self.gathered_heads = np.empty((0, FINGERPRINT_LEN), dtype=np.int64)
        self.gathered_carries = np.empty((0, CARRY_BYTES), dtype=np.uint8)
        self._typed_carries: dict[Any, list[np.ndarray[Any, Any]]] = {}

    def resize(self, world: int) -> None:
        """Size the gathered rows for ``world`` ranks (the views made before are dropped)."""
        self.world = world
        self.gathered_rows = array("q", bytes(8 * ROW * world))
        rows_t = torch.frombuffer(self.gathered_rows, dtype=torch.int64)
        # one view per rank: gloo's list all-gather measured faster than all_gather_single
        self.gathered_row_tensors = list(rows_t.view(world, ROW).unbind(0))
        rows = np.frombuffer(self.gathered_rows, dtype=np.int64).reshape(world, ROW)
        self.gathered_heads = rows[:, :FINGERPRINT_LEN]
        self.gathered_carries = rows[:, FINGERPRINT_LEN:].view(np.uint8)
        raw = memoryview(self.gathered_rows).cast("B")
        self.gathered_head_bytes = [
            raw[r * ROW * 8 : (r * ROW + FINGERPRINT_LEN) * 8] for r in range(world)
        ]
        self.gathered_row_bytes = [raw[r * ROW * 8 : (r + 1) * ROW * 8] for r in range(world)]
        self._typed_carries.clear()

    def put_carry(self, carry: np.ndarray[Any, Any]) -> None:
        """Copy ``carry``'s bytes (at most `CARRY_BYTES`) into this rank's row."""
        if not carry.flags.c_contiguous:
            carry = np.ascontiguousarray(carry)  # a strided view: copied
        self.own_carry[: carry.nbytes] = carry.reshape(-1).view(np.uint8)

    def typed_carries(self, dtype: Any, nbytes: int) -> list[np.ndarray[Any, Any]]:
        """Each rank's carried bytes as ``nbytes`` of ``dtype``: views, made once per kind."""
        key = (dtype, nbytes)
        copies = self._typed_carries.get(key)
        if copies is None:
            typed = self.gathered_carries[:, :nbytes].view(dtype)
            copies = self._typed_carries[key] = list(typed)
        return copies

    def all_heads_equal_own(self) -> bool:
        """Whether every rank's gathered fingerprint is this rank's."""
        mine = self.own_head_bytes
        return all(head == mine for head in self.gathered_head_bytes)
