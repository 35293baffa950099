"""refimpl.demos.torchft_job: a torchft job of replica groups on this machine, one killed mid-step.

The survivors keep committing steps with a smaller quorum, the replacement heals from a peer
(no checkpoint: the job has no checkpoint directory) and every group ends with the same
weights. Nothing is left running, whether the job finishes or runs out of time.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from helpers.torchft import replicas_running

from refimpl.demos.torchft_job import (
    final_weights,
    max_difference,
    replay_weights,
    run_ft_job,
    sample_counts,
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_group_is_replaced_and_heals_while_the_others_step(tmp_path: Path) -> None:
    job = run_ft_job(tmp_path, replicas=3, steps=12, die=(1, 4), hold_rejoin_at=8, timeout_s=180)
    assert job.quorum_runs() == [(0, 3, [0, 1, 2]), (4, 7, [0, 2]), (8, 11, [0, 1, 2])]
    assert sorted(job.aborted()) == [(4, 0), (4, 2)]  # the step the kill hit, refused
    assert job.heals() == [(1, 0, 8)]  # from a peer: no checkpoint directory exists
    assert not any(p.is_dir() for p in tmp_path.iterdir() if p.name != "gates")
    weights = final_weights(job)
    assert sorted(weights) == [0, 1, 2]
    assert all(max_difference(weights[0], weights[r]) == 0.0 for r in (1, 2))
    assert max_difference(weights[0], replay_weights(job)) < 1e-5
    assert max_difference(weights[0], replay_weights(job, every_group=True)) > 1e-3
    counts = sample_counts(job)  # 12 steps of 3 x 8 = 2 epochs of 144 samples
    assert {e: set(c.values()) for e, c in counts.items()} == {0: {1}, 1: {1}}
    assert [len(c) for c in counts.values()] == [144 - 2 * 8, 144 - 2 * 8]
    assert replicas_running(tmp_path) == []


@pytest.mark.timeout(120)
def test_a_job_out_of_time_is_killed_whole(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="did not finish in time"):
        run_ft_job(tmp_path, replicas=2, steps=10_000, step_sleep=0.5, timeout_s=2)
    assert replicas_running(tmp_path) == []


class _Started:
    """What `run_ft_job` reads of one start: the quorum of each run of steps."""

    def __init__(self, first_quorum: list[int]) -> None:
        self.first_quorum, self.start_retries = first_quorum, 0

    def quorum_runs(self) -> list[tuple[int, int, list[int]]]:
        return [(0, 3, self.first_quorum), (4, 11, [0, 1, 2])]


@pytest.mark.parametrize(
    ("firsts", "kwargs", "starts", "retries"),
    [
        ([[1, 2], [0, 1, 2]], {}, 2, 1),  # a group missed the first quorum: once more
        ([[1, 2], [1, 2]], {}, 2, 1),  # and only once
        ([[0, 1, 2]], {}, 1, 0),
        ([[1, 2]], {"kill_every": 5.0}, 1, 0),  # the benchmark's kills: noise, not a start
        ([[1, 2]], {"ckpt_dir": "ckpt"}, 1, 0),  # a rerun would resume from its steps
    ],
)
def test_a_group_that_missed_the_first_quorum_starts_the_job_again_once(
    firsts: list[list[int]],
    kwargs: dict[str, object],
    starts: int,
    retries: int,
    tmp_path: Path,
) -> None:
    """Before: a group that asked for the first quorum over 3 s after the others (a heavy
    make test) trained from step 1, and chapter 13's sample accounting failed. `start`
    stands for `run_ft_job`'s body, with the parameters the retry reads."""
    from refimpl.demos.torchft_job import _retried_if_a_group_missed_the_first_quorum

    made: list[_Started] = []

    @_retried_if_a_group_missed_the_first_quorum
    def start(
        out: Path,
        *,
        replicas: int = 3,
        die: tuple[int, int] | None = None,
        kill_every: float | None = None,
        ckpt_dir: str | None = None,
    ) -> _Started:
        made.append(_Started(firsts[len(made)]))
        return made[-1]

    job = start(tmp_path, replicas=3, **kwargs)  # type: ignore[arg-type]
    assert len(made) == starts and job is made[-1] and job.start_retries == retries
    # run_ft_job is that retry around its body, with the body's signature
    assert inspect.unwrap(run_ft_job) is not run_ft_job
    assert inspect.signature(run_ft_job) == inspect.signature(inspect.unwrap(run_ft_job))
