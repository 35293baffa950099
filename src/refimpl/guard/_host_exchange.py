"""`HostExchange`: every rank's fixed-size row, passed over Unix datagram sockets when every
rank of a group runs on one host. `refimpl.guard.CollectiveGuard` checks each call with it.

Why not a gloo all-gather, as the guard did before: a gloo collective goes through the
process group's work queue and gloo's threads, where a datagram to each peer and a ``recv``
happen in the calling thread; ``python -m refimpl.bench guard`` times a guarded all-reduce
with each (chapter 7 shows the numbers).

Each rank binds a socket in Linux's abstract namespace under a random name (nothing on disk
to clean up; the kernel drops the name when the last descriptor closes, so a dead rank's
name disappears). A child forked from a rank (a DataLoader worker under ``fork``) would keep
the name bound after the rank died, and its peers would wait out the timeout instead of
seeing it gone: every forked child closes its copies at once (``os.register_at_fork``).
The names travel in one all-gather in the caller's group; each rank then checks it can
reach every peer's name (``connect`` sends nothing) and the ranks agree, with one
all-reduce, to use the sockets only if every rank reached every peer. Ranks on different
hosts (or in different network namespaces) cannot, and keep the gloo path.

Ordering: a datagram socket keeps each sender's messages in order, and a rank sends exactly
one row per call, so the *k*-th row from a peer is that peer's *k*-th call. Rows from a peer
that is ahead wait in a per-peer queue. A rank that gives up waiting sends a *withdrawal*
after its row, so a peer that arrives late reads the row and then the withdrawal, and fails
as it would have with gloo instead of going on with a peer that left.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import time
import weakref
from collections import deque
from typing import Any, NoReturn

import torch
import torch.distributed as dist

MAX_WORLD = 16
"""Above this many ranks the guard keeps the gloo all-gather: each rank sends a datagram to
every peer, and the kernel queues at most ``net.unix.max_dgram_qlen`` (10 by default) per
socket before senders must retry."""
_ROW, _WITHDRAW = 1, 2  # message kinds
_HEAD = 16  # bytes before the row: sender's rank and kind, two int64
_PROBE_EVERY_S = 1.0  # while waiting, how often to check that the missing peers still exist


_OPEN: weakref.WeakSet[socket.socket] = weakref.WeakSet()  # this process's guard sockets
_EXCHANGES: weakref.WeakSet[HostExchange] = weakref.WeakSet()


def _close_in_forked_child() -> None:
    """In a forked child: close its copies of the rank's sockets, so that a name stays bound
    only as long as the rank itself lives; an exchange used here says why it cannot work."""
    for sock in list(_OPEN):
        sock.close()
    for ex in list(_EXCHANGES):
        ex._broken = (
            f"this process (pid {os.getpid()}) is a forked child of rank {ex.me}; "
            "a guard works only in the rank that built it"
        )


os.register_at_fork(after_in_child=_close_in_forked_child)


class ExchangeFailed(RuntimeError):
    """Not every rank's row for this call arrived: the wait ran out, a peer's process is
    gone, or a peer gave up on this call. The message says which."""


def _name(token: int, rank: int) -> bytes:
    return b"\0refimpl-guard/%016x/%d" % (token, rank)


def _reachable(address: bytes) -> bool:
    """Whether a socket is bound at ``address`` in this host's abstract namespace."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(address)  # a datagram connect only looks the name up
    except OSError:
        return False
    finally:
        probe.close()
    return True


class HostExchange:
    """Rows of ``row_bytes`` exchanged between ``world`` ranks of one host; see the module."""

    def __init__(self, sock: socket.socket, me: int, tokens: list[int], row_bytes: int) -> None:
        self.me, self.world, self.row_bytes = me, len(tokens), row_bytes
        self._sock = sock
        self._peers = [(r, _name(t, r)) for r, t in enumerate(tokens) if r != me]
        self._rank_of = {address: r for r, address in self._peers}
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._msg = bytearray(_HEAD + row_bytes)
        self._msg[:_HEAD] = torch.tensor([me, _ROW], dtype=torch.int64).numpy().tobytes()
        self._scratch = bytearray(_HEAD + row_bytes + 1)  # one byte more: oversize shows
        self._kinds = memoryview(self._scratch)[:_HEAD].cast("q")
        self._stash: dict[int, deque[bytes]] = {r: deque() for r, _ in self._peers}
        self._broken = ""
        _OPEN.add(sock)
        _EXCHANGES.add(self)
        weakref.finalize(self, sock.close)  # a dropped guard frees its name, quietly

    @classmethod
    def connect(cls, group: Any, row_bytes: int, *, wanted: bool = True) -> HostExchange | None:
        """A collective over ``group``: every rank of it must call this, with any ``wanted``.
        The exchange if every rank wanted one and reached every other over a socket, else
        None on every rank (then use the group)."""
        world, me = dist.get_world_size(group), dist.get_rank(group)
        if world < 2 or world > MAX_WORLD:
            return None  # the same decision on every rank: no collectives here
        sock, token = None, 0
        if wanted and sys.platform.startswith("linux"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _OPEN.add(sock)
            for _ in range(3):  # a random name; a clash (never seen) draws again
                token = int.from_bytes(os.urandom(8), "little") >> 1
                try:
                    sock.bind(_name(token, me))
                    break
                except OSError:
                    token = 0
        tokens = torch.zeros(world, dtype=torch.int64)
        dist.all_gather_into_tensor(tokens, torch.tensor([token]), group=group)
        names = tokens.tolist()
        ok = all(names) and all(_reachable(_name(t, r)) for r, t in enumerate(names) if r != me)
        agree = torch.tensor([int(ok)])
        dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
        if sock is not None and not (ok and agree.item()):
            sock.close()
        if not agree.item():
            return None
        assert sock is not None
        sock.setblocking(False)
        return cls(sock, me, names, row_bytes)

    def exchange(self, row: memoryview, rows: list[memoryview], timeout_s: float) -> None:
        """Send ``row`` to every peer and fill ``rows[r]`` with rank r's row for this call
        (``rows[me]`` with ``row``). Raises `ExchangeFailed` if that cannot happen within
        ``timeout_s``; after that, every later call raises too (the ranks are out of step)."""
        if self._broken:
            raise ExchangeFailed(self._broken)
        rows[self.me][:] = row
        msg = self._msg
        msg[_HEAD:] = row
        unsent = self._send(msg, self._peers)
        missing = set()
        for r, _ in self._peers:
            queued = self._stash[r]
            if queued:
                self._take(r, memoryview(queued.popleft()), rows)
            else:
                missing.add(r)
        started = probed = 0.0
        while missing or unsent:
            try:
                n, address = self._sock.recvfrom_into(self._scratch)
            except BlockingIOError:
                if unsent:
                    unsent = self._send(msg, unsent)
                now = time.monotonic()
                if not started:
                    started = probed = now
                elif now - started >= timeout_s:
                    waited = ", ".join(map(str, sorted(missing))) or "a full queue"
                    self._fail(f"waited {timeout_s:g} s for rank(s) {waited}")
                elif now - probed >= _PROBE_EVERY_S:
                    probed = now
                    self._check_alive(missing | {r for r, _ in unsent})
                wait_s = 0.001 if unsent else min(_PROBE_EVERY_S, timeout_s - (now - started))
                self._poll.poll(max(1, int(wait_s * 1000)))
                continue
            sender = self._sender(n, address)
            if sender in missing and not self._stash[sender]:
                missing.discard(sender)
                self._take(sender, memoryview(self._scratch)[:n], rows)
            elif sender >= 0:
                self._stash[sender].append(bytes(self._scratch[:n]))
        self._drain()  # a peer that gave up on this call left a withdrawal after its row
        for r, queued in self._stash.items():
            if queued and queued[0][8] == _WITHDRAW:
                self._fail(f"rank {r} gave up waiting at this call")

    def withdraw(self) -> None:
        """Tell every peer this rank gave up on the call it last sent (best effort)."""
        self._msg[8:16] = _WITHDRAW.to_bytes(8, "little")
        for _, address in self._peers:
            with contextlib.suppress(OSError):  # that peer is gone or full: it fails alone
                self._sock.sendto(self._msg, address)
        self._msg[8:16] = _ROW.to_bytes(8, "little")

    def close(self) -> None:
        """Release the socket (its name disappears with it)."""
        self._sock.close()

    def _send(self, msg: bytearray, peers: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Send to each peer; those whose queue is full, to try again."""
        unsent = []
        for r, address in peers:
            try:
                self._sock.sendto(msg, address)
            except BlockingIOError:
                unsent.append((r, address))
            except OSError as exc:  # ECONNREFUSED: nothing is bound at that name any more
                self._fail(f"rank {r}'s process is gone ({exc.strerror})")
        return unsent

    def _sender(self, n: int, address: Any) -> int:
        """The rank a received message came from, or -1 for anything that is not a peer's
        message of the right size sent from that peer's own socket. Any local process can
        write to the name; none can send from a peer's name while the peer holds it."""
        rank = self._rank_of.get(address, -1)
        if n != _HEAD + self.row_bytes or rank < 0:
            return -1
        claimed, kind = self._kinds
        return rank if claimed == rank and kind in (_ROW, _WITHDRAW) else -1

    def _take(self, rank: int, message: memoryview, rows: list[memoryview]) -> None:
        if message[8] == _WITHDRAW:
            self._fail(f"rank {rank} gave up waiting at this call")
        rows[rank][:] = message[_HEAD:]

    def _drain(self) -> None:
        """Queue whatever has already arrived, without waiting."""
        while True:
            try:
                n, address = self._sock.recvfrom_into(self._scratch)
            except BlockingIOError:
                return
            sender = self._sender(n, address)
            if sender >= 0:
                self._stash[sender].append(bytes(self._scratch[:n]))

    def _check_alive(self, ranks: set[int]) -> None:
        for r, address in self._peers:
            if r in ranks and not _reachable(address):
                self._fail(f"rank {r}'s process is gone")

    def _fail(self, why: str) -> NoReturn:
        self._broken = f"an earlier exchange failed ({why}); the ranks are out of step"
        raise ExchangeFailed(why)
