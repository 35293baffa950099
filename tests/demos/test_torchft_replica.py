"""refimpl.demos.torchft_replica: one replica group's training loop.

torchft 0.2.0's own DistributedDataParallel kills the survivors when a peer dies in the middle
of a step: its comm hook asserts on a future that a failed all-reduce never created. The
replica's wrapper returns the bucket instead (the step is refused by should_commit), which
tests/test_torchft_job.py shows working; this file pins the failure it works around.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.torchft import replicas_running

from refimpl.demos.torchft_job import run_ft_job
from refimpl.demos.torchft_replica import parse_args


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchfts_own_ddp_wrapper_kills_the_survivors(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)exited with 1.*assert fut\._fut"):
        run_ft_job(tmp_path, replicas=2, steps=8, die=(1, 3), stock_ddp=True, timeout_s=180)
    assert replicas_running(tmp_path) == []


def test_the_command_line_reads_its_gates() -> None:
    args = parse_args(
        [
            "--replica",
            "1",
            "--replicas",
            "3",
            "--lighthouse",
            "http://h:1",
            "--out",
            "o",
            "--hold",
            "0:/g/start",
            "--hold",
            "8:/g/rejoin",
            "--die-at-step",
            "4",
        ]
    )
    assert (args.replica, args.replicas, args.die_at_step) == (1, 3, 4)
    assert args.hold == ["0:/g/start", "8:/g/rejoin"] and not args.stock_ddp
