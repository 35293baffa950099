"""What `refimpl.guard`'s guards raise: `CollectiveMismatch` for calls that differ, and the
report for an exchange that failed (a rank that never came, left, or gave up), built only on
that path."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from refimpl.guard._fingerprint import GuardedCall, decode
from refimpl.guard._host_exchange import ExchangeFailed


class CollectiveMismatch(RuntimeError):
    """Ranks disagreed on a guarded collective, or one never reached it.

    ``calls`` holds each rank's `GuardedCall` (for a timeout: the last call each rank recorded,
    ``None`` where a rank recorded none); ``str(err)`` is a table of them."""

    def __init__(self, message: str, calls: Sequence[GuardedCall | None]) -> None:
        super().__init__(message)
        self.calls = list(calls)

    def __reduce__(self) -> tuple[Any, ...]:  # survive pickling back to the launcher
        return (type(self), (str(self), self.calls))


def mismatch_report(me: int, heads: Sequence[list[int]]) -> CollectiveMismatch:
    """The error for fingerprints that differ (rank r's at ``heads[r]``), seen from rank
    ``me``: every rank's call, one line each."""
    calls = [decode(r, head) for r, head in enumerate(heads)]
    table = "\n".join(f"  {c}" for c in calls)
    return CollectiveMismatch(
        f"ranks disagree on collective #{calls[me].seq} (this is rank {me}):\n"
        f"{table}\nEvery rank must make the same collectives in the same order; look for a "
        "branch\nthat depends on the rank's data (which dataset, task or split it drew).",
        calls,
    )


@dataclass(frozen=True)
class Where:
    """What a failed exchange's report needs to know about the guard."""

    me: int
    world: int
    store: Any  # the process group's store, or None
    key: str  # this guard's prefix in the store
    timeout_s: float
    last_passed: list[int] | None  # the last fingerprint every rank agreed on


def timeout_report(
    where: Where, fp: list[int], exc: Exception, arrived: float, failed_after: float
) -> CollectiveMismatch:
    """The fingerprint exchange failed: not every rank came (in time). Leave this rank's call
    in the store for its peers' reports, read theirs, and say what each rank did."""
    me, world, store, timeout_s = where.me, where.world, where.store, where.timeout_s
    mine = decode(me, fp)
    record = f"{arrived:.3f} " + " ".join(map(str, fp))
    store_ok = store is not None
    if store is not None:  # only a failing rank writes: nothing on the hot path
        try:
            store.set(f"{where.key}/{me}", record)
        except Exception:  # the store may be gone with the rank that held it
            store_ok = False
    last: list[GuardedCall | None] = [None] * world
    last[me] = mine
    lines, peers_since = [], []
    for r in range(world):
        if r == me:
            lines.append(f"  {mine}  <- waiting")
            continue
        gave_up = _peer_record(store, f"{where.key}/{r}", mine.seq, r) if store_ok else None
        if gave_up is not None:
            since, last[r] = gave_up
            peers_since.append(since)
            lines.append(f"  {last[r]}  <- waited here, gave up")
        elif where.last_passed is not None:
            last[r] = decode(r, where.last_passed)
            done = str(last[r]).split(": ", 1)[1]
            lines.append(f"  rank {r} last passed {done}, then no record")
        else:
            lines.append(f"  rank {r}: no guarded call passed yet")
    at = f"{mine.op} {mine.name!r} (call #{mine.seq})"
    why = (
        "A rank that made fewer guarded calls, an unguarded collective, or a stuck rank does this:"
    )
    if failed_after >= timeout_s / 2:
        head = f"rank {me} waited {timeout_s:g} s at {at} and not every rank arrived"
    elif peers_since:  # failed at once: the peers had waited at this very call and left
        head = (
            f"rank {me} arrived at {at} {arrived - min(peers_since):.1f} s late, after its "
            f"peers gave up (they wait {timeout_s:g} s). A task on this rank alone "
            "(rank 0 saving, evaluating) longer than the guard's timeout does this: make "
            "timeout_s longer than that task"
        )
        why = "Each rank's last call:"
    else:  # failed at once: the peers had left (finished, or failed) before this call
        head = f"rank {me} reached {at} after its peers had left, and did not wait"
    # the host exchange says what it saw (a peer gone, or given up); gloo's text is long
    said = str(exc) if isinstance(exc, ExchangeFailed) else type(exc).__name__
    head += f" (failed after {failed_after:.1f} s: {said}). {why}"
    return CollectiveMismatch(head + "\n" + "\n".join(lines), last)


def _peer_record(store: Any, key: str, seq: int, rank: int) -> tuple[float, GuardedCall] | None:
    """What ``rank`` left in the store when its exchange at call ``seq`` failed, if it did."""
    try:
        if not store.check([key]):
            return None
        since, *fp = store.get(key).decode().split()
        call = decode(rank, [int(x) for x in fp])
    except Exception:  # the store may be gone with the rank that held it
        return None
    return (float(since), call) if call.seq == seq else None  # older: another failure
