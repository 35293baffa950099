"""refimpl.trainstate: one collective capture gathers every rank's RNG to rank 0; one
collective resume gives each rank its own stream back, the same step and manifest everywhere,
or an error on every rank; another world size keeps the sampler's position and fresh RNGs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from workers import trainstate as w

from refimpl.checkpoint import PACK, CheckpointError, load_latest, save_checkpoint
from refimpl.data import ResumableSampler
from refimpl.launch import spawn
from refimpl.state import STATE_KEYS
from refimpl.trainstate import (
    capture_every_rank,
    check_same_checkpoint,
    manifest_digest,
    resume_every_rank,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:  # type: ignore[type-arg]
    ckpt = tmp_path_factory.mktemp("trainstate") / "ckpt"
    return ckpt, spawn(w.capture_then_draw, 2, str(ckpt), 6, timeout_s=60)


@pytest.mark.timeout(90)
def test_capture_gathers_every_ranks_rng_to_rank_0_only(saved: tuple[Path, list]) -> None:  # type: ignore[type-arg]
    _, ranks = saved
    assert ranks[1]["state"] is None  # rank 1 took part in the gather and got nothing to save
    assert ranks[0]["state"] == {
        "keys": sorted([*STATE_KEYS, "best_val_loss", "config"]),
        "world_size": 2,
        "rngs": 2,
    }
    assert ranks[0]["after"] != ranks[1]["after"]  # two streams, both needed


@pytest.mark.timeout(90)
def test_resume_gives_each_rank_its_own_stream_and_the_users_keys(
    saved: tuple[Path, list],  # type: ignore[type-arg]
) -> None:
    ckpt, before = saved
    after = spawn(w.resume_then_draw, 2, str(ckpt), timeout_s=60)
    for rank in (0, 1):
        got = after[rank]
        assert got["next"] == before[rank]["after"], rank  # rank r continues rank r's stream
        assert got["rng_restored"] and not got["kept_own_stream"]
        assert got["step"] == 6 and got["weight_restored"]
        assert got["extra"] == {"best_val_loss": 1.5, "config": {"lr": 0.1}}
        assert got["sampler"] == {"seed": 0, "epoch": 1, "position": 8}
    assert after[0]["digest"] == after[1]["digest"] != ""


@pytest.mark.timeout(90)
def test_another_world_size_keeps_the_position_and_each_ranks_fresh_stream(
    saved: tuple[Path, list],  # type: ignore[type-arg]
) -> None:
    ckpt, _ = saved
    after = spawn(w.resume_then_draw, 3, str(ckpt), timeout_s=60)
    assert [a["rng_restored"] for a in after] == [False] * 3
    assert all(a["kept_own_stream"] for a in after)  # the rule: no stream is borrowed
    assert all(a["sampler"] == {"seed": 0, "epoch": 1, "position": 8} for a in after)
    assert all(a["extra"]["best_val_loss"] == 1.5 and a["step"] == 6 for a in after)
    # and without a process group (a world of one): the same rule, in this process
    model, opt = w.tiny_model()
    torch.manual_seed(5)
    fresh = torch.get_rng_state()
    resumed = resume_every_rank(ckpt, model, opt)
    assert resumed is not None and not resumed.rng_restored
    assert torch.equal(torch.get_rng_state(), fresh)


@pytest.mark.timeout(30)
def test_without_a_group_capture_is_this_process_state_and_resumes_it(tmp_path: Path) -> None:
    model, opt = w.tiny_model()
    sampler = ResumableSampler(10, batch_size=2, rank=0, world_size=1)
    state = capture_every_rank(
        model, opt, sampler_state=sampler.state_dict(), step=3, extra={"note": "x"}
    )
    assert state is not None and state["world_size"] == 1 and len(state["rng"]) == 1
    expected = torch.rand(3)
    save_checkpoint(tmp_path, state, 3)
    resumed = resume_every_rank(tmp_path, model, opt, sampler=sampler)
    assert resumed is not None and resumed.rng_restored and resumed.extra == {"note": "x"}
    assert torch.equal(torch.rand(3), expected)
    assert resume_every_rank(tmp_path / "empty", model, opt) is None
    check_same_checkpoint(3, "abc")  # no group: nothing to compare, no error


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("views", "agree"),
    [
        ([(4, "aa"), (4, "aa")], True),
        ([(None, None), (None, None)], True),  # nobody found one: all start fresh together
        ([(4, "aa"), (8, "bb")], False),  # a lagging filesystem: another newest step
        ([(4, "aa"), (4, "bb")], False),  # the same step, other bytes (node-local copies)
        ([(4, "aa"), (None, None)], False),  # one rank sees no checkpoint at all
    ],
)
def test_check_same_checkpoint_raises_on_every_rank_naming_each_view(
    views: list[tuple[int | None, str | None]], agree: bool
) -> None:
    got = spawn(w.check_views, 2, views, timeout_s=40)
    if agree:
        assert got == [None, None]
        return
    for rank, report in enumerate(got):
        assert report["seen"] == views, report  # every rank raised, with every rank's view
        assert report["message"].startswith(f"rank {rank}: ranks found different latest")
        assert "rank 1: step" in report["message"] and "in ckpt" in report["message"]


def _two_dirs(tmp_path: Path, second: dict[str, torch.Tensor]) -> list[str]:
    a, b = tmp_path / "node0", tmp_path / "node1"
    save_checkpoint(a, {"model": {"w": torch.zeros(2)}, "step": 4}, 4)
    save_checkpoint(b, second, 4)
    return [str(a), str(b)]


@pytest.mark.timeout(60)
def test_resume_refuses_ranks_that_loaded_different_copies_of_one_step(tmp_path: Path) -> None:
    dirs = _two_dirs(tmp_path, {"model": {"w": torch.ones(2)}, "step": 4})  # same step, other bytes
    reports = spawn(w.resume_from_own_dir, 2, dirs, timeout_s=40)
    steps = [[s for s, _ in r["seen"]] for r in reports]
    assert steps == [[4, 4], [4, 4]]  # the step agrees; only the digest tells them apart
    digests = [manifest_digest(load_latest_manifest(d)) for d in dirs]
    assert reports[0]["seen"] == [(4, digests[0]), (4, digests[1])] and digests[0] != digests[1]


def load_latest_manifest(ckpt_dir: str) -> dict:  # type: ignore[type-arg]
    seen: dict = {}  # type: ignore[type-arg]
    assert load_latest(ckpt_dir, on_load=lambda d, m: seen.update(m)) is not None
    return seen


@pytest.mark.timeout(60)
def test_refimpl_trains_loader_uses_the_same_check(tmp_path: Path) -> None:
    a, b = tmp_path / "node0", tmp_path / "node1"
    model, opt = w.tiny_model()
    state = capture_every_rank(model, opt, step=4)
    assert state is not None
    save_checkpoint(a, state, 4)
    save_checkpoint(b, state, 4)
    save_checkpoint(b, state, 8)  # node 1 sees a newer step than node 0
    reports = spawn(w.train_files_load_from_own_dir, 2, [str(a), str(b)], timeout_s=40)
    assert [[s for s, _ in r["seen"]] for r in reports] == [[4, 8], [4, 8]]
    assert "Put the checkpoint directory on a filesystem every node sees" in reports[1]["message"]


@pytest.mark.timeout(60)
def test_committed_steps_that_all_fail_to_load_stop_every_rank_instead_of_starting_over(
    tmp_path: Path,
) -> None:
    model, opt = w.tiny_model()
    state = capture_every_rank(model, opt, step=4)
    assert state is not None
    step_dir = save_checkpoint(tmp_path, state, 4)
    (step_dir / PACK).write_bytes(b"flipped")  # the only step: committed, now unloadable
    skipped: list[str] = []
    with pytest.raises(CheckpointError, match=r"none of them loads \(step_00000004: .*state\.pack"):
        resume_every_rank(tmp_path, model, opt, on_skip=lambda d, why: skipped.append(d.name))
    assert skipped == ["step_00000004"]  # the caller's on_skip still hears of it
    got = spawn(w.resume_or_error, 2, str(tmp_path), timeout_s=40)
    assert all(g.startswith("CheckpointError: ") and "none of them loads" in g for g in got), got
    assert step_dir.is_dir()  # nothing was trained over it


def _same(a: dict | None, b: dict | None) -> bool:  # type: ignore[type-arg]
    assert a is not None and b is not None
    return a["scale"] == b["scale"] and all(
        torch.equal(p, q) for p, q in zip(a["weights"], b["weights"], strict=True)
    )


@pytest.mark.timeout(120)
def test_resume_mid_accumulation_restores_scaler_and_micro_step(tmp_path: Path) -> None:
    """A checkpoint taken before micro-batch 2 of step 1 (of 4): resumed, the run ends with
    the uninterrupted run's weights bit for bit and its scale (halved by step 0's overflow,
    not the fresh scaler's 65536). Captured without the micro-step, the 2 micro-batches in
    .grad are lost and the weights differ: the trap this guards against."""
    whole = w.accumulate(str(tmp_path / "unused"))
    assert whole is not None and whole["scale"] == 32768.0  # 65536 * backoff 0.5, once
    assert w.accumulate(str(tmp_path / "a"), (1, 2)) is None
    resumed = w.accumulate(str(tmp_path / "a"), resume=True)
    assert _same(resumed, whole)
    found = load_latest(tmp_path / "a", keys=["micro_step", "scaler"])
    assert found is not None and found[1]["micro_step"] == 2
    assert found[1]["scaler"]["scale"] == 32768.0
    assert w.accumulate(str(tmp_path / "b"), (1, 2), save_micro=False) is None
    lost = w.accumulate(str(tmp_path / "b"), resume=True)
    assert lost is not None and not _same(lost, whole)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_resume_mid_accumulation_under_ddp_no_sync_is_bit_identical(tmp_path: Path) -> None:
    """2 ranks, DDP with no_sync on all but the last micro-batch: each rank's un-averaged
    gradients are gathered into the checkpoint and each rank gets its own back; a restart at
    another world size is refused, naming both."""
    whole = spawn(w.accumulate, 2, str(tmp_path / "unused"), timeout_s=120)
    assert spawn(w.accumulate, 2, str(tmp_path / "a"), (1, 2), timeout_s=120) == [None, None]
    resumed = spawn(w.accumulate, 2, str(tmp_path / "a"), None, True, timeout_s=120)
    assert all(_same(r, whole[0]) for r in resumed) and _same(whole[1], whole[0])
    found = load_latest(tmp_path / "a")
    assert found is not None and len(found[1]["grads"]) == 2
    assert not torch.equal(found[1]["grads"][0]["0.weight"], found[1]["grads"][1]["0.weight"])
    with pytest.raises(
        ValueError, match=r"micro-step 2\) by 2 ranks, and this run has world size 1"
    ):
        w.accumulate(str(tmp_path / "a"), resume=True)
