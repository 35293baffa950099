"""refimpl.demos.multinode: the pieces of chapter 11's runs of torchrun agents as nodes.

The runs themselves (a fixed two-node job restarted bit-identical, an elastic job that loses
a node and trains every sample once, three nodes that lose the store's host) are chapter 11's
cells: nbval runs them and their asserts and compares their output, so they are not run a
second time here."""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path

import pytest

from refimpl.demos.multinode import (
    agent_command,
    ephemeral_range,
    free_port,
    rank0_attempts,
    trained_once,
)

ARGS = [
    "--steps",
    "8",
    "--save-every",
    "3",
    "--samples",
    "64",
    "--seed",
    "3",
    "--ckpt-dir",
    "ckpt",
    "--final-weights",
    "w.pt",
]


@pytest.mark.timeout(10)
def test_each_node_meets_at_one_c10d_endpoint_and_only_a_serves_the_store() -> None:
    a = agent_command(["--steps", "3"], nnodes="1:2", port=1234, rdzv_id="r", host=True)
    b = agent_command(["--steps", "3"], nnodes="1:2", port=1234, rdzv_id="r", host=False)
    for cmd in (a, b):
        assert "--nnodes=1:2" in cmd and "--nproc-per-node=1" in cmd
        assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=127.0.0.1:1234" in cmd
        assert cmd[-4:] == ["-m", "refimpl.train", "--steps", "3"]
    conf_a = next(c for c in a if c.startswith("--rdzv-conf="))
    conf_b = next(c for c in b if c.startswith("--rdzv-conf="))
    assert "last_call_timeout=1" in conf_a and "keep_alive_interval=1" in conf_a
    assert conf_a.endswith("is_host=1") and conf_b.endswith("is_host=0")


@pytest.mark.timeout(10)
def test_the_rendezvous_port_is_one_the_kernel_never_hands_out_unasked() -> None:
    # Issue 25's flake: a port from bind(("127.0.0.1", 0)) is ephemeral; in the seconds before
    # node a's torchrun listens on it, any process that connects anywhere can be given it as
    # its local port, and then a fails with EADDRINUSE and b waits 60 s for nothing.
    first, last = ephemeral_range()
    assert 1024 <= first <= last <= 65535
    ports = {free_port() for _ in range(30)}
    assert not any(first <= p <= last for p in ports), (sorted(ports), first, last)
    assert not any(29000 <= p < 30000 for p in ports)  # torchrun's customary ports
    assert len(ports) > 20  # drawn at random: two harnesses at once rarely pick one port
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))  # still free: nothing listens there


@pytest.mark.timeout(10)
def test_rank0_attempts_reads_world_and_resume_step_and_skips_a_start_that_never_loaded() -> None:
    lines = [
        "[rank1] start: world 2, restart 0, device cpu",
        "[rank0] start: world 2, restart 0, device cpu",
        "[rank0] no checkpoint in ckpt: starting at step 0",
        "[rank0] start: world 2, restart 1, device cpu",  # killed before it loaded
        "[rank0] start: world 1, restart 2, device cpu",
        "[rank0] resumed from step_3",
    ]
    assert rank0_attempts(lines) == [
        {"world": 2, "resumed_from": 0},
        {"world": 1, "resumed_from": 3},
    ]


@pytest.mark.timeout(10)
def test_trained_once_keeps_the_last_attempt_of_each_step_and_counts_padding_apart(
    tmp_path: Path,
) -> None:
    # 10 samples, 1 per rank per step. World 2 trains steps 1-3 (positions 0-5), is killed in
    # step 3 after a save at step 2; world 1 replays step 3 (position 4) and goes on.
    (tmp_path / "s.rank0").write_text("1 0 0\n2 0 2\n3 0 4\n3 0 4\n4 0 5\n5 0 6\n")
    (tmp_path / "s.rank1").write_text("1 0 1\n2 0 3\n3 0 5\n")  # its step 3 was lost
    # back to world 2 after step 5, resumed from it: 7, 8 | 9 and a padding repeat of 0
    (tmp_path / "s.rank0").write_text((tmp_path / "s.rank0").read_text() + "6 0 7\n7 0 9\n8 1 3\n")
    (tmp_path / "s.rank1").write_text((tmp_path / "s.rank1").read_text() + "6 0 8\n7 0 0\n8 1 5\n")
    attempts = [
        {"world": 2, "resumed_from": 0},
        {"world": 1, "resumed_from": 2},
        {"world": 2, "resumed_from": 5},
    ]
    got = trained_once(tmp_path / "s", attempts, samples=10)
    assert got["ranks"] == {1: 2, 2: 2, 3: 1, 4: 1, 5: 1, 6: 2, 7: 2, 8: 2}
    assert got["epochs"][0] == Counter(range(10)) and got["padding"] == {0: 1, 1: 0}
    assert got["epochs"][1] == Counter([3, 5])
    # the negative control: counting every line, the lost step's samples come twice
    flat = Counter(
        int(i)
        for p in tmp_path.glob("s.rank*")
        for ln in p.read_text().splitlines()
        if ln.split()[1] == "0"
        for i in ln.split()[2:]
    )
    assert flat[4] == 2 and flat[5] == 2


@pytest.mark.timeout(30)
def test_an_agent_that_exits_before_the_first_round_is_told_apart_from_a_slow_start(
    tmp_path: Path,
) -> None:
    """Before: an agent that died at start left the others waiting for world 3 until the
    120 s timeout (seen once under a heavy ``make test``: torch's rendezvous closed a joining
    agent's store connection), and chapter 11's cell failed."""
    import subprocess
    import time

    from refimpl.demos import multinode

    run = multinode.TwoNodes(tmp_path, ARGS, nnodes="2:3")
    gone = multinode.Node("b", subprocess.Popen(["true"]), "token")
    waiting = multinode.Node("a", subprocess.Popen(["sleep", "30"]), "token")
    run.nodes = [waiting, gone]
    gone.proc.wait()
    started = time.monotonic()
    try:
        with pytest.raises(multinode.NodeExited, match="node b exited before"):
            run.wait_for("start: world 3", timeout_s=20, while_all_run=True)
        with pytest.raises(TimeoutError) as waited:  # without it: one agent still runs
            run.wait_for("start: world 3", timeout_s=1)
        assert not isinstance(waited.value, multinode.NodeExited)
    finally:
        waiting.proc.kill()
        waiting.proc.wait()
    assert time.monotonic() - started < 5  # not the deadline: the exit is seen at once


def test_a_failed_start_is_run_again_once_in_an_emptied_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from refimpl.demos import multinode

    calls: list[list[str]] = []

    def once(work: Path, *args: object) -> dict[str, object]:
        calls.append(sorted(p.name for p in work.iterdir()))
        (work / "ckpt").mkdir()  # what the failed try left behind
        if len(calls) == 1:
            return {"error": "node b exited before the first round formed", "start_failed": True}
        return {"before": {}, "after": {}}

    monkeypatch.setattr(multinode, "_lose_store_host_once", once)
    out = multinode.lose_store_host(tmp_path / "w", ARGS, share_store=True, kill_after_step=1)
    assert calls == [[], []] and out == {"before": {}, "after": {}, "start_retries": 1}

    def never_starts(work: Path, *args: object) -> dict[str, object]:
        calls.append([])
        return {"error": "x", "start_failed": True}

    calls.clear()
    monkeypatch.setattr(multinode, "_lose_store_host_once", never_starts)
    out = multinode.lose_store_host(tmp_path / "v", ARGS, share_store=True, kill_after_step=1)
    assert len(calls) == 2 and out == {"error": "x", "start_retries": 1}  # once only
