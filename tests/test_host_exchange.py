"""refimpl.guard._host_exchange: the guard's check over Unix datagram sockets on one host.

The exchange itself is tested in one process, a thread per rank (no process group needed);
`HostExchange.connect`'s vote and the guard's use of it, with real ranks."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from typing import Any

import pytest
from workers import host_exchange as workers

from refimpl.guard._host_exchange import _HEAD, ExchangeFailed, HostExchange, _name
from refimpl.launch import spawn

ROW = 64  # bytes per row in the in-process tests


def _ranks(world: int) -> list[HostExchange]:
    tokens = [int.from_bytes(os.urandom(7), "little") for _ in range(world)]
    out = []
    for r in range(world):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(_name(tokens[r], r))
        sock.setblocking(False)
        out.append(HostExchange(sock, r, tokens, ROW))
    return out


def _row(rank: int, call: int) -> memoryview:
    return memoryview(bytes([rank, call % 256]) * (ROW // 2))


def _run_calls(ex: HostExchange, calls: int, seen: list[list[int]], timeout_s: float) -> None:
    rows = [memoryview(bytearray(ROW)) for _ in range(ex.world)]
    for k in range(calls):
        ex.exchange(_row(ex.me, k), rows, timeout_s)
        seen[ex.me].append(sum(bytes(r) == bytes(_row(i, k)) for i, r in enumerate(rows)))


def _threads(targets: list[threading.Thread]) -> None:
    for t in targets:
        t.start()
    for t in targets:
        t.join(timeout=60)
        assert not t.is_alive()


@pytest.mark.timeout(60)
def test_every_call_gets_every_ranks_row_for_that_call() -> None:
    # three ranks racing through 300 calls: a peer one call ahead has its row queued, and the
    # k-th row from each peer must still be that peer's k-th call
    ranks = _ranks(3)
    seen: list[list[int]] = [[], [], []]
    _threads([threading.Thread(target=_run_calls, args=(ex, 300, seen, 20.0)) for ex in ranks])
    assert seen == [[3] * 300] * 3


@pytest.mark.timeout(60)
def test_a_full_queue_is_retried_not_lost() -> None:
    a, b = _ranks(2)
    # fill b's queue with messages b will drop (a sender that is no rank): a's send finds it
    # full and must retry once b starts reading
    junk = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    junk.setblocking(False)
    message = (99).to_bytes(8, "little") + (1).to_bytes(8, "little") + bytes(ROW)
    filled = 0
    try:
        while True:
            junk.sendto(message, _peer_name(a, b))
            filled += 1
    except BlockingIOError:
        pass
    junk.close()
    assert filled >= 1
    seen: list[list[int]] = [[], []]
    first = threading.Thread(target=_run_calls, args=(a, 5, seen, 20.0))
    first.start()
    time.sleep(0.3)  # a is now retrying its send into b's full queue
    assert first.is_alive()
    second = threading.Thread(target=_run_calls, args=(b, 5, seen, 20.0))
    _threads([second])
    first.join(timeout=30)
    assert seen == [[2] * 5, [2] * 5]


def _peer_name(a: HostExchange, b: HostExchange) -> bytes:
    """b's socket name, as a knows it."""
    return dict(a._peers)[b.me]


def _message(rank: int, kind: int, row: bytes = bytes(ROW)) -> bytes:
    return rank.to_bytes(8, "little") + kind.to_bytes(8, "little") + row


def test_hostile_datagrams_are_dropped() -> None:
    a, b = _ranks(2)
    to_b = _peer_name(a, b)
    forged = _message(0, 1, bytes(_row(0, 0)))  # rank 0's row for call 0, exactly
    # from a's own socket: right sender, wrong contents
    for message in (
        b"short",
        bytes(_HEAD + ROW + 1),  # one byte too long
        _message(5, 1),  # claims a rank that does not exist
        _message(1, 1),  # claims to be b itself
        _message(0, 7),  # no such kind
    ):
        a._sock.sendto(message, to_b)
    # from strangers: an unnamed socket, and one bound to a name of its own
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
        stranger.sendto(forged, to_b)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
        stranger.bind(b"\0refimpl-test-stranger-%d" % os.getpid())
        stranger.sendto(forged, to_b)
        stranger.sendto(_message(0, 2), to_b)  # a forged withdrawal
    seen: list[list[int]] = [[], []]
    _threads([threading.Thread(target=_run_calls, args=(ex, 3, seen, 20.0)) for ex in (a, b)])
    assert seen == [[2] * 3, [2] * 3]


def test_a_peer_that_never_comes_times_out_and_the_exchange_stays_failed() -> None:
    a, _b = _ranks(2)
    rows = [memoryview(bytearray(ROW)) for _ in range(2)]
    started = time.monotonic()
    with pytest.raises(ExchangeFailed, match=r"waited 0.3 s for rank\(s\) 1"):
        a.exchange(_row(0, 0), rows, 0.3)
    assert 0.3 <= time.monotonic() - started < 5
    with pytest.raises(ExchangeFailed, match=r"an earlier exchange failed .* out of step"):
        a.exchange(_row(0, 1), rows, 0.3)


def test_a_late_rank_reads_the_withdrawal_and_fails() -> None:
    a, b = _ranks(2)
    rows = [memoryview(bytearray(ROW)) for _ in range(2)]
    with pytest.raises(ExchangeFailed):
        b.exchange(_row(1, 0), rows, 0.2)
    b.withdraw()
    # a arrives late: b's row for this call is queued, then b's withdrawal
    with pytest.raises(ExchangeFailed, match="rank 1 gave up waiting at this call"):
        a.exchange(_row(0, 0), rows, 5.0)


@pytest.mark.parametrize("when", ["before", "while waiting"])
def test_a_peer_whose_socket_is_gone_fails_fast(when: str) -> None:
    a, b = _ranks(2)
    rows = [memoryview(bytearray(ROW)) for _ in range(2)]
    if when == "before":
        b.close()
    else:
        threading.Timer(0.3, b.close).start()
    started = time.monotonic()
    with pytest.raises(ExchangeFailed, match="rank 1's process is gone"):
        a.exchange(_row(0, 0), rows, 30.0)
    assert time.monotonic() - started < 3  # not the 30 s timeout: the probe found it gone


# --- with real ranks: the vote, and the guard on top --------------------------------------


def test_ranks_on_one_host_use_the_sockets() -> None:
    assert spawn(workers.guard_path, 2, -1, [True, True]) == [("host", "mismatch")] * 2


def test_a_rank_that_cannot_reach_its_peers_sends_every_rank_to_gloo() -> None:
    assert spawn(workers.guard_path, 3, 1, [True] * 3) == [("gloo", "mismatch")] * 3


def test_one_rank_asking_for_gloo_sends_every_rank_to_gloo() -> None:
    assert spawn(workers.guard_path, 2, -1, [True, False]) == [("gloo", "mismatch")] * 2


def test_a_guard_whose_peer_left_says_so_at_once() -> None:
    rank0, rank1 = spawn(workers.peer_leaves, 2, timeout_s=60)
    first, again, seconds = rank0
    assert seconds < 5  # the guard's timeout is 30 s
    assert "after its peers had left" in first and "rank 1's process is gone" in first, first
    assert "out of step" in again, again
    assert rank1 == ("left", "", 0.0)


def test_a_peer_that_left_is_seen_gone_though_its_forked_worker_lives() -> None:
    # A forked child inherits the rank's socket, and a name stays bound while any descriptor
    # of it is open: without closing it in the child, rank 0 waited the guard's whole 30 s.
    rank0, rank1 = spawn(workers.peer_leaves_with_forked_workers, 2, timeout_s=90)
    first, seconds = rank0
    assert "rank 1's process is gone" in first, first
    assert seconds < 5  # the probe's 1 s, not the guard's 30 s timeout
    assert rank1 == ("left", 0.0)


def _use_in_child(ex: HostExchange, out: Any) -> None:
    rows = [memoryview(bytearray(ROW)) for _ in range(ex.world)]
    try:
        ex.exchange(_row(ex.me, 0), rows, 1.0)
        out.put("no error")
    except ExchangeFailed as exc:
        out.put(str(exc))


def test_a_forked_child_closes_its_copy_and_cannot_use_the_exchange() -> None:
    a, b = _ranks(2)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_use_in_child, args=(a, out))
    child.start()
    said = out.get(timeout=30)
    child.join(timeout=30)
    assert "is a forked child of rank 0" in said, said
    # the parent's name is still bound (the child closed only its own copy): b reaches a
    seen: list[list[int]] = [[], []]
    _threads([threading.Thread(target=_run_calls, args=(ex, 3, seen, 20.0)) for ex in (a, b)])
    assert seen == [[2] * 3, [2] * 3]
