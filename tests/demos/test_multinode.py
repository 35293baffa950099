"""refimpl.demos.multinode: two torchrun agents on one machine, as two nodes. The slow tests
run chapter 11's two multi-node claims on real agents: a fixed two-node job whose worker dies
restarts both nodes and ends bit-identical to an uninterrupted run; an elastic job that loses
a whole node goes on alone and trains every sample of the interrupted epoch exactly once; and
a three-node job that loses the node serving torchrun's shared store hands a survivor's worker
the dead address, unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path

import pytest

from refimpl.demos.multinode import (
    agent_command,
    elastic_loss,
    ephemeral_range,
    fixed_restart,
    free_port,
    lose_store_host,
    rank0_attempts,
    trained_once,
)
from refimpl.demos.train import run_train, same_weights

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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_fixed_two_node_job_whose_worker_dies_restarts_both_nodes_bit_identical(
    tmp_path: Path,
) -> None:
    (tmp_path / "ref").mkdir()
    ref = run_train(ARGS, cwd=tmp_path / "ref", timeout_s=100)  # --standalone, 2 ranks
    assert ref.returncode == 0, ref.stderr[-2000:]
    run = fixed_restart(
        tmp_path / "two", [*ARGS, "--fail-at-step", "5", "--fail-rank", "1"], timeout_s=100
    )
    assert run["exit"] == [0, 0], run["log"]
    assert run["attempts"] == [{"world": 2, "resumed_from": 0}, {"world": 2, "resumed_from": 3}]
    # both nodes started their worker again: the failed one spends a restart; the other one
    # either sees its own worker fail (gloo) or the failed node waiting (no restart spent)
    starts = [sum(ln.startswith(f"[rank{r}] start:") for ln in run["lines"]) for r in (0, 1)]
    assert starts == [2, 2], run["log"]
    assert any("Worker group FAILED" in line for line in run["log"]), run["log"]
    assert same_weights(tmp_path / "ref" / "w.pt", tmp_path / "two" / "w.pt")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_elastic_job_that_loses_a_node_goes_on_alone_and_trains_each_sample_once(
    tmp_path: Path,
) -> None:
    args = [*ARGS, "--steps", "10", "--step-sleep", "0.25", "--sample-log", "samples"]
    run = elastic_loss(tmp_path, args, kill_after_step=4, regrow=False, timeout_s=100)
    assert "error" not in run and run["exit"][0] == 0, run["log"]
    assert run["attempts"] == [{"world": 2, "resumed_from": 0}, {"world": 1, "resumed_from": 3}]
    assert 0 < run["shrink"]["seen_s"] <= run["shrink"]["worker_s"] <= run["shrink"]["step_s"]
    got = trained_once(tmp_path / "samples", run["attempts"], samples=64)
    assert got["ranks"][3] == 2 and got["ranks"][4] == 1 and got["ranks"][10] == 1
    assert got["epochs"][0] == Counter(range(64)) and got["padding"][0] == 0
    assert max(got["epochs"][1].values()) == 1
    assert (tmp_path / "w.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_nodes_losing_the_shared_store_host_hand_a_survivor_the_dead_address(
    tmp_path: Path,
) -> None:
    # torch 2.13's next_rendezvous rebuilds an agent's cached store address only on its first
    # rendezvous or when it becomes rank 0 without a server: node a (rank 2, then rank 1)
    # keeps node b's. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every round publishes afresh.
    args = [
        *ARGS,
        "--steps",
        "10",
        "--save-every",
        "2",
        "--samples",
        "96",
        "--step-sleep",
        "0.25",
        "--pg-timeout",
        "20",
    ]
    shared = lose_store_host(
        tmp_path / "shared", args, share_store=True, kill_after_step=3, timeout_s=120
    )
    assert "error" not in shared, shared["log"]
    assert len(set(shared["before"].values())) == 1  # one store for the first round: b's
    assert shared["after"]["a"] == shared["before"]["b"], shared
    assert shared["after"]["c"] != shared["before"]["b"], shared
    assert shared["listening"] == {"a": False, "c": True}, shared
    fresh = lose_store_host(
        tmp_path / "fresh", args, share_store=False, kill_after_step=3, timeout_s=120
    )
    assert "error" not in fresh, fresh["log"]
    assert fresh["after"]["a"] == fresh["after"]["c"] != fresh["before"]["b"], fresh
    assert fresh["listening"] == {"a": True, "c": True}, fresh
    assert fresh["exit"][0] == 0 and fresh["exit"][2] == 0, fresh["log"]
    assert [a["world"] for a in fresh["attempts"]] == [3, 2], fresh["log"]
    assert (tmp_path / "fresh" / "w.pt").exists()
