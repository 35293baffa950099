"""Chapter 7: collectives that check every rank is making the same call, before making it.

A collective only pairs the ranks' *n*-th calls with each other; nothing checks that those
calls mean the same thing. When ranks disagree (rank 0 reduces ``"seg/loss"`` while rank 1
reduces ``"cls/acc"``) the job either hangs (the calls differ in kind or count) or, when the
tensors happen to match in shape and dtype, returns wrong numbers with no error at all.
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` catches the first kind (it compares op, shape and dtype)
but not the second: it has no idea what a tensor *means*.

`CollectiveGuard` gives every collective a ``name``. Before each call the ranks exchange a
fixed-size fingerprint (sequence number, op, name, shape, dtype: 32 int64): over Unix
datagram sockets when every rank runs on one host (``guard/_host_exchange.py``), else with
one all-gather in a gloo group of the guard's own (chapter 7 and ``python -m refimpl.bench
guard`` measure both). Every rank then holds
every rank's call, and if they differ every rank raises `CollectiveMismatch` naming what
each rank was calling, so the job stops at the first divergent call instead of hanging or
averaging the wrong metric.
A small all-reduce (a metric's sum and count: up to `CARRY_BYTES` on the CPU) travels in the
same exchange and each rank reduces the copies itself, so a guarded metric sync is one
exchange; a larger one is the check, then the all-reduce. Nothing else happens on the
way: no store traffic, and the fingerprint of each kind of call is built once. If the
exchange itself fails (a rank skipped the call, is stuck elsewhere, or gave up waiting), the
error names each rank's last call: the last one all ranks passed together, or, for a rank
that waited at this very call and gave up, that call, which a failing rank leaves in the
process group's store.

`ReferenceGuard` is the same check written plainly (one all-gather of the fingerprint per
call, nothing cached or carried): read it first, then `CollectiveGuard` as that plus its
speed-ups. Both give the same verdict and the same `CollectiveMismatch` for the same calls.

Example::

    guard = CollectiveGuard()
    guard.all_reduce(loss_sum, name="train/seg/loss")
"""

from __future__ import annotations

from refimpl.guard._collective_guard import CARRY_BYTES, CollectiveGuard
from refimpl.guard._fingerprint import FINGERPRINT_LEN, MAX_DIMS, NAME_BYTES, GuardedCall
from refimpl.guard._reference import ReferenceGuard
from refimpl.guard._report import CollectiveMismatch

__all__ = [
    "CARRY_BYTES",
    "FINGERPRINT_LEN",
    "MAX_DIMS",
    "NAME_BYTES",
    "CollectiveGuard",
    "CollectiveMismatch",
    "GuardedCall",
    "ReferenceGuard",
]

# documented, and pickled by reference, as refimpl.guard's (a CollectiveMismatch raised in a
# rank reaches the parent through pickle)
for _public in (GuardedCall, CollectiveMismatch, CollectiveGuard, ReferenceGuard):
    _public.__module__ = __name__
del _public
