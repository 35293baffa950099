"""Chapter 7: collectives that check every rank is making the same call, before making it.

A collective only pairs the ranks' *n*-th calls with each other; nothing checks that those
calls mean the same thing. When ranks disagree (rank 0 reduces ``"seg/loss"`` while rank 1
reduces ``"cls/acc"``) the job either hangs (the calls differ in kind or count) or, when the
tensors happen to match in shape and dtype, returns wrong numbers with no error at all.
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` catches the first kind (it compares op, shape and dtype)
but not the second: it has no idea what a tensor *means*.

`CollectiveGuard` gives every collective a ``name``. Before each call the ranks exchange a
fixed-size fingerprint (sequence number, op, name, shape, dtype: 32 int64) with one
all-gather in a gloo group of the guard's own; every rank then holds every rank's call, and
if they differ every rank raises `CollectiveMismatch` naming what each rank was calling, so
the job stops at the first divergent call instead of hanging or averaging the wrong metric.
That is one small extra collective per guarded call and nothing else on the way: no store
traffic, and the fingerprint of each kind of call is built once. If the exchange itself
fails (a rank skipped the call, is stuck elsewhere, or gave up waiting), the error names
each rank's last call: the last one all ranks passed together, or, for a rank that waited
at this very call and gave up, that call, which a failing rank leaves in the process
group's store.

Example::

    guard = CollectiveGuard()
    guard.all_reduce(loss_sum, name="train/seg/loss")
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveGuard", "CollectiveMismatch", "GuardedCall"]

FINGERPRINT_LEN = 32
"""int64 slots per fingerprint: 16 of header and shape, 16 holding up to 112 bytes of name
(a longer name is told apart by its hash, and shown cut to 112 bytes)."""
MAX_DIMS = 8
NAME_BYTES = 112
_CACHED_FINGERPRINTS = 1024  # kinds of call (op, name, dtype, shape) kept ready per guard
_MAGIC = 0x7E57_6A4D  # a fingerprint whose slot 0 is not this was not written by a guard
_OPS = ("all_reduce", "broadcast", "all_gather", "barrier", "reduce_scatter")
# Every dtype torch defines, by name, sorted: the same index on every rank of one torch build
# (a fixed short table let uint16 pass for uint32 and one float8 for another).
_DTYPES = tuple(sorted({str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}))
# Every reduce op by its enum value (BAND and BOR were once one "other" code).
_REDUCE_OPS = {int(v.value): k for k, v in dist.ReduceOp.RedOpType.__members__.items()}


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


class CollectiveMismatch(RuntimeError):
    """Ranks disagreed on a guarded collective, or one never reached it.

    ``calls`` holds each rank's `GuardedCall` (for a timeout: the last call each rank recorded,
    ``None`` where a rank recorded none); ``str(err)`` is a table of them."""

    def __init__(self, message: str, calls: Sequence[GuardedCall | None]) -> None:
        super().__init__(message)
        self.calls = list(calls)

    def __reduce__(self) -> tuple[Any, ...]:  # survive pickling back to the launcher
        return (type(self), (str(self), self.calls))


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


def _fingerprint(
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
        # a dtype outside torch's namespace (none today) still differs by its name's hash
        dtype = _DTYPES.index(name_of) if name_of in _DTYPES else -2 - _name_hash(name_of)
        ndim = tensor.dim()
        shape[:ndim] = tensor.shape
    return [_MAGIC, seq, _OPS.index(op), name_hash, detail, length, dtype, ndim, *shape, *chunks]


def _decode(rank: int, v: list[int]) -> GuardedCall:
    if v[0] != _MAGIC or not 0 <= v[2] < len(_OPS):
        return GuardedCall(rank, -1, "?", "<not a guard fingerprint>", "?", ())
    raw = b"".join(x.to_bytes(7, "little") for x in v[16:])
    name = raw[: v[5]].decode(errors="replace")
    dtype = (
        "none"
        if v[6] == -1
        else _DTYPES[v[6]].removeprefix("torch.")
        if 0 <= v[6] < len(_DTYPES)
        else "other"
    )
    op = _OPS[v[2]]
    detail = "" if op in ("barrier", "all_gather") else f"({_detail_name(op, v[4])})"
    return GuardedCall(rank, v[1], op, name, dtype, tuple(v[8 : 8 + v[7]]), detail)


def _detail_name(op: str, code: int) -> str:
    if op == "broadcast":
        return f"src={code}"
    return _REDUCE_OPS.get(code, f"op{code}")


def _reduce_code(op: Any) -> int:
    """The op's enum value: ``ReduceOp.BAND`` is a ``RedOpType``; ``ReduceOp(...)`` wraps one
    in ``.op``. (A PREMUL_SUM's factor is not compared.)"""
    return int(getattr(op, "op", op))


def _group_timeout(group: Any) -> float:
    """The timeout ``group`` (default: WORLD) was created with, in seconds.

    torch keeps it in each backend's options (``ProcessGroupGloo`` and ``ProcessGroupNCCL``
    both expose ``options._timeout``); `default_pg_timeout` if no backend says.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in pg._device_types:
        timeout = getattr(getattr(pg._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout.total_seconds()
    return dist.default_pg_timeout.total_seconds()


class CollectiveGuard:
    """Named collectives that raise `CollectiveMismatch` on every rank when ranks disagree.

    ``group``: the process group the collectives run in (default: WORLD). The fingerprints
    travel in a gloo group of their own (host-side even when the training collectives are
    NCCL) with timeout ``timeout_s``, by default ``group``'s own timeout: a shorter one would
    kill a healthy job whose rank 0 works alone (saves, evaluates) for longer than it, where
    the group itself would have waited. Creating it is a collective: build the guard on every
    rank at start-up. ``enabled=False`` (or ``REFIMPL_GUARD=0`` in the environment) makes every
    method a plain collective: the off switch for a run that has been checked.

    Every rank must route the same collectives through the guard; a collective made outside
    it is invisible to it and shows up as the *next* guarded call timing out.
    """

    _created = 0

    def __init__(
        self, group: Any = None, *, enabled: bool = True, timeout_s: float | None = None
    ) -> None:
        self.enabled = enabled and os.environ.get("REFIMPL_GUARD", "1") != "0"
        self.group = group
        if timeout_s is None:
            timeout_s = _group_timeout(group) if dist.is_initialized() else 60.0
        self.timeout_s = timeout_s
        self.seq = 0
        self._check_group: Any = None
        self._store: Any = None
        self._world: int | None = None  # set with the check group (or at the first check)
        self._me = 0
        # This rank's fingerprint and every rank's, as int64 arrays that tensors share: the
        # hot path fills and compares them in plain Python, without building tensors.
        self._fp = array("q", bytes(8 * FINGERPRINT_LEN))
        self._fp_t = torch.frombuffer(self._fp, dtype=torch.int64)
        self._all = array("q")
        self._all_t = torch.empty(0, dtype=torch.int64)
        self._fingerprints: dict[Any, array[int]] = {}
        self._last_passed: array[int] | None = None  # the last call every rank agreed on
        # Guards are created in the same order on every rank (creation is collective), so a
        # per-process count names the same guard everywhere: the store key for last calls.
        CollectiveGuard._created += 1
        self._key = f"refimpl_guard/{CollectiveGuard._created}"
        if self.enabled and dist.is_initialized():
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self._check_group = dist.new_group(
                ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
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
        if not self.enabled or not dist.is_initialized():
            return
        # None: the process group appeared after the guard was built
        world = self._world if self._world is not None else self._join()
        fp = self._fp
        fp[:] = self._static_part(op, name, tensor, detail)
        fp[1] = self.seq
        self.seq += 1
        arrived, started = time.time(), time.monotonic()
        # One all-gather of a fixed-size fingerprint: every rank gets every rank's call at
        # once, so agreeing costs one collective and disagreeing needs no second one.
        try:
            dist.all_gather_single(self._all_t, self._fp_t, group=self._check_group)
        except RuntimeError as exc:
            failed_after = time.monotonic() - started
            raise self._timeout_error(fp.tolist(), exc, arrived, failed_after) from exc
        if self._all == fp * world:  # every rank's copy equals this rank's
            self._last_passed = array("q", fp)
            return
        n = FINGERPRINT_LEN
        calls = [_decode(r, self._all[r * n : (r + 1) * n].tolist()) for r in range(world)]
        table = "\n".join(f"  {c}" for c in calls)
        raise CollectiveMismatch(
            f"ranks disagree on collective #{calls[self._me].seq} (this is rank {self._me}):\n"
            f"{table}\nEvery rank must make the same collectives in the same order; look for a "
            "branch\nthat depends on the rank's data (which dataset, task or split it drew).",
            calls,
        )

    def _join(self) -> int:
        """Size the buffer that receives every rank's fingerprint, once the group exists."""
        world = self._world = dist.get_world_size(self._check_group)
        self._me = dist.get_rank(self._check_group)
        self._all = array("q", bytes(8 * FINGERPRINT_LEN * world))
        self._all_t = torch.frombuffer(self._all, dtype=torch.int64)
        return world

    def _static_part(
        self, op: str, name: str, tensor: torch.Tensor | None, detail: int
    ) -> array[int]:
        """The call's fingerprint with sequence number 0, built once per kind of call."""
        key = (op, name, detail, None if tensor is None else (tensor.dtype, tuple(tensor.shape)))
        fp = self._fingerprints.get(key)
        if fp is None:
            if len(self._fingerprints) >= _CACHED_FINGERPRINTS:
                self._fingerprints.clear()
            fp = array("q", _fingerprint(0, op, name, tensor, detail))
            self._fingerprints[key] = fp
        return fp

    def _timeout_error(
        self, fp: list[int], exc: Exception, arrived: float, failed_after: float
    ) -> CollectiveMismatch:
        """The fingerprint exchange failed: not every rank came (in time). Leave this rank's
        call in the store for its peers' reports, read theirs, and say what each rank did."""
        me, world = self._me, self._world or 1
        mine = _decode(me, fp)
        record = f"{arrived:.3f} " + " ".join(map(str, fp))
        store_ok = self._store is not None
        if self._store is not None:  # only a failing rank writes: nothing on the hot path
            try:
                self._store.set(f"{self._key}/{me}", record)
            except Exception:  # the store may be gone with the rank that held it
                store_ok = False
        last: list[GuardedCall | None] = [None] * world
        last[me] = mine
        lines, peers_since = [], []
        for r in range(world):
            if r == me:
                lines.append(f"  {mine}  <- waiting")
                continue
            gave_up = self._peer_record(r, mine.seq) if store_ok else None
            if gave_up is not None:
                since, last[r] = gave_up
                peers_since.append(since)
                lines.append(f"  {last[r]}  <- waited here, gave up")
            elif self._last_passed is not None:
                last[r] = _decode(r, self._last_passed.tolist())
                done = str(last[r]).split(": ", 1)[1]
                lines.append(f"  rank {r} last passed {done}, then no record")
            else:
                lines.append(f"  rank {r}: no guarded call passed yet")
        at = f"{mine.op} {mine.name!r} (call #{mine.seq})"
        why = (
            "A rank that made fewer guarded calls, an unguarded collective, or a stuck rank "
            "does this:"
        )
        if failed_after >= self.timeout_s / 2:
            head = f"rank {me} waited {self.timeout_s:g} s at {at} and not every rank arrived"
        elif peers_since:  # failed at once: the peers had waited at this very call and left
            head = (
                f"rank {me} arrived at {at} {arrived - min(peers_since):.1f} s late, after its "
                f"peers gave up (they wait {self.timeout_s:g} s). A task on this rank alone "
                "(rank 0 saving, evaluating) longer than the guard's timeout does this: make "
                "timeout_s longer than that task"
            )
            why = "Each rank's last call:"
        else:  # failed at once: the peers had left (finished, or failed) before this call
            head = f"rank {me} reached {at} after its peers had left, and did not wait"
        head += f" (failed after {failed_after:.1f} s: {type(exc).__name__}). {why}"
        return CollectiveMismatch(head + "\n" + "\n".join(lines), last)

    def _peer_record(self, rank: int, seq: int) -> tuple[float, GuardedCall] | None:
        """What ``rank`` left in the store when its exchange at call ``seq`` failed, if it did."""
        key = f"{self._key}/{rank}"
        try:
            if not self._store.check([key]):
                return None
            since, *fp = self._store.get(key).decode().split()
            call = _decode(rank, [int(x) for x in fp])
        except Exception:  # the store may be gone with the rank that held it
            return None
        return (float(since), call) if call.seq == seq else None  # older: another failure

    def all_reduce(self, tensor: torch.Tensor, *, name: str, op: Any = dist.ReduceOp.SUM) -> None:
        """``dist.all_reduce(tensor, op)`` in ``group``, after checking every rank agrees."""
        self.check("all_reduce", name, tensor, _reduce_code(op))
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
        """A barrier that also checks every rank is at the same named point."""
        self.check("barrier", name)
        if not self.enabled:
            dist.barrier(group=self.group)
