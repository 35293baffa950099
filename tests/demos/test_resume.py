"""Chapter 6's demos: MiniMind's step conversion miscounts; our resume is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from refimpl.demos.resume import (
    count_lost_repeated,
    ddp_gradient_at_float32_max,
    lost_repeated_table,
    minimind_draws,
    minimind_sizes,
    resume_experiment,
)
from refimpl.launch import spawn


def test_minimind_conversion_repeats_rounded_away_steps() -> None:
    # 2 -> 4 GPUs after 1 step: 1 * 2 // 4 = 0 batches skipped, so the 8 drawn are redrawn.
    assert count_lost_repeated(100, minimind_draws(100, 4, 2, 4, 1)) == (0, 8)
    # Same world size: nothing lost, nothing repeated.
    assert count_lost_repeated(100, minimind_draws(100, 4, 2, 2, 5)) == (0, 0)


def test_minimind_one_gpu_uses_another_permutation() -> None:
    lost, repeated = count_lost_repeated(100, minimind_draws(100, 4, 2, 1, 5))
    assert lost > 0 and repeated > 0


def test_table_resumable_columns_are_zero() -> None:
    rows = lost_repeated_table(100, 4, [(2, 4), (3, 2), (4, 3), (1, 2)], [1, 5])
    assert all(r["resumable lost"] == 0 and r["resumable repeated"] == 0 for r in rows)
    assert any(r["minimind repeated"] > 0 for r in rows)


def test_minimind_sizes_follow_the_model_shapes() -> None:
    mm = minimind_sizes()
    # Counted while writing chapter 6: MiniMindForCausalLM(MiniMindConfig(hidden_size=512)) from
    # jingyaogong/minimind model/model_minimind.py at e8484874, sum of p.numel() over
    # model.parameters() (the tied embedding/lm_head once).
    assert mm["params"] == 25_829_888
    tied = 6400 * 512
    assert mm["weights_fp16"] == 2 * (mm["params"] + tied)  # .half() copies the tied matrix
    assert mm["resume_fp32"] == 12 * mm["params"]  # fp32 weights + AdamW's two moments
    assert mm["resume_fp16"] == mm["weights_fp16"] + 8 * mm["params"]
    # Another width changes every term: hidden 768 gives a 2048-wide MLP (64 * ceil(2048/64)).
    assert minimind_sizes(hidden=768)["params"] > mm["params"]


def test_ddp_divides_by_the_world_size_before_the_all_reduce_sums() -> None:
    results = spawn(ddp_gradient_at_float32_max, 2, timeout_s=120)
    for r in results:
        assert r["sum_then_divide"] == float("inf")  # 3e38 + 3e38 overflows float32
        assert r["ddp"] == pytest.approx(3e38, rel=1e-6)  # 3e38 / 2 + 3e38 / 2 does not


@pytest.mark.slow
def test_resume_same_world_size_is_bit_identical(tmp_path: Path) -> None:
    r = resume_experiment(str(tmp_path))
    assert r["resumed_losses"] == r["full_losses"]
    assert r["resumed_order"] == r["full_order"]
    assert torch.equal(r["resumed_params"], r["full_params"])


@pytest.mark.slow
@pytest.mark.parametrize("what", ["optimizer", "rng"])
def test_resume_negative_controls_differ(tmp_path: Path, what: str) -> None:
    r = resume_experiment(
        str(tmp_path), restore_optimizer=what != "optimizer", restore_rng=what != "rng"
    )
    assert r["resumed_order"] == r["full_order"]
    assert r["resumed_losses"][:5] == r["full_losses"][:5]
    assert r["resumed_losses"][5:] != r["full_losses"][5:]
    assert not torch.equal(r["resumed_params"], r["full_params"])


@pytest.mark.slow
def test_resume_across_world_size_same_order_close_losses(tmp_path: Path) -> None:
    r = resume_experiment(str(tmp_path), ws_before=2, ws_after=4, dropout=0.0)
    assert r["resumed_order"] == r["full_order"]
    torch.testing.assert_close(
        torch.tensor(r["resumed_losses"]), torch.tensor(r["full_losses"]), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(r["resumed_params"], r["full_params"], rtol=1e-5, atol=1e-6)
