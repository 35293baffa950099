"""The fingerprint `refimpl.guard.CollectiveGuard` exchanges: a call as 32 int64, and back.

Slots: a magic number, the sequence number, the op, the name's hash, the op's detail (reduce
op or broadcast source), the name's length, the dtype (and device), the number of dims, 8
dims, and 16 slots of 7 bytes of the name. Equal fingerprints mean the same call.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

FINGERPRINT_LEN = 32
"""int64 slots per fingerprint: 16 of header and shape, 16 holding up to 112 bytes of name
(a longer name is told apart by its hash, and shown cut to 112 bytes)."""
MAX_DIMS = 8
"""The most dimensions a guarded tensor may have: its shape fills 8 slots (a tensor of more
dims is refused with `ValueError`)."""
NAME_BYTES = 112
"""Bytes of a call's name (UTF-8) the fingerprint holds, 7 per slot in 16 slots; names that
differ only after them are still told apart by the name's hash."""
_MAGIC = 0x7E57_6A4D  # a fingerprint whose slot 0 is not this was not written by a guard
_OPS = ("all_reduce", "broadcast", "all_gather", "barrier", "reduce_scatter")
# Every dtype torch defines, by name, sorted: the same index on every rank of one torch build
# (a fixed short table let uint16 pass for uint32 and one float8 for another).
_DTYPES = tuple(sorted({str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}))
# Every reduce op by its enum value (BAND and BOR were once one "other" code).
REDUCE_OPS = {int(v.value): k for k, v in dist.ReduceOp.RedOpType.__members__.items()}
# The device type shares the dtype slot (code + _DEVICE_STEP * device), so that a CPU tensor
# on one rank and a CUDA tensor on another differ, as the path each takes would.
_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "meta", "privateuseone")
_DEVICE_STEP = 4096


@dataclass(frozen=True)
class GuardedCall:
    """What one rank was about to call: decoded from its fingerprint."""

    rank: int
    seq: int
    op: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    detail: str = ""

    def __str__(self) -> str:
        extra = f" {self.detail}" if self.detail else ""
        shape = "x".join(map(str, self.shape)) or "scalar"
        call = f"{self.op}{extra} {self.name!r} {self.dtype}[{shape}]"
        return f"rank {self.rank}: call #{self.seq} {call}"


def _name_hash(name: str) -> int:
    # 62 bits, so that negating it (see `CollectiveGuard.check`) cannot overflow int64
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 2


@functools.lru_cache(maxsize=4096)
def _name_slots(name: str) -> tuple[int, ...]:
    """The name's hash, byte length and first 128 bytes as 16 int64: cached per name."""
    raw = name.encode()
    padded = raw[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
    # 7 bytes per slot: a slot stays below 2**56, so its negation fits in int64 too
    chunks = [int.from_bytes(padded[i : i + 7], "little") for i in range(0, NAME_BYTES, 7)]
    return (_name_hash(name), min(len(raw), NAME_BYTES), *chunks)


def fingerprint(
    seq: int, op: str, name: str, tensor: torch.Tensor | None, detail: int
) -> list[int]:
    name_hash, length, *chunks = _name_slots(name)
    shape = [-1] * MAX_DIMS
    if tensor is None:
        dtype, ndim = -1, 0
    else:
        if tensor.dim() > MAX_DIMS:
            raise ValueError(
                f"CollectiveGuard: {name!r} has {tensor.dim()} dims; at most {MAX_DIMS}"
            )
        name_of = str(tensor.dtype)
        device = tensor.device.type
        # a dtype outside torch's namespace (none today) still differs by its name's hash
        dtype = _DTYPES.index(name_of) if name_of in _DTYPES else -2 - _name_hash(name_of)
        if dtype >= 0:
            code = _DEVICES.index(device) if device in _DEVICES else len(_DEVICES)
            dtype += _DEVICE_STEP * code
        ndim = tensor.dim()
        shape[:ndim] = tensor.shape
    return [_MAGIC, seq, _OPS.index(op), name_hash, detail, length, dtype, ndim, *shape, *chunks]


def decode(rank: int, v: list[int]) -> GuardedCall:
    if v[0] != _MAGIC or not 0 <= v[2] < len(_OPS):
        return GuardedCall(rank, -1, "?", "<not a guard fingerprint>", "?", ())
    raw = b"".join(x.to_bytes(7, "little") for x in v[16:])
    name = raw[: v[5]].decode(errors="replace")
    device, code = divmod(v[6], _DEVICE_STEP) if v[6] >= 0 else (0, v[6])
    dtype = (
        "none"
        if code == -1
        else _DTYPES[code].removeprefix("torch.")
        if 0 <= code < len(_DTYPES)
        else "other"
    )
    if device:
        dtype = f"{(*_DEVICES, 'other')[min(device, len(_DEVICES))]}:{dtype}"
    op = _OPS[v[2]]
    detail = "" if op in ("barrier", "all_gather") else f"({_detail_name(op, v[4])})"
    return GuardedCall(rank, v[1], op, name, dtype, tuple(v[8 : 8 + v[7]]), detail)


def _detail_name(op: str, code: int) -> str:
    if op == "broadcast":
        return f"src={code}"
    return REDUCE_OPS.get(code, f"op{code}")


def reduce_code(op: Any) -> int:
    """The op's enum value: ``ReduceOp.BAND`` is a ``RedOpType``; ``ReduceOp(...)`` wraps one
    in ``.op``. (A PREMUL_SUM's factor is not compared.)"""
    return int(getattr(op, "op", op))
