"""``refimpl.train`` resumed with flags that contradict its checkpoint (`refimpl.train._flags`).

Another ``--lr`` used to train at the checkpoint's rate, ``--steps`` below the committed step
said "done", another ``--samples`` continued the saved position in another dataset, another
``--seed`` was refused in the sampler's words after the model was restored. Each is refused
before anything is trained or written, naming the flag to pass; ``--reset-lr`` applies the new
rate and says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from refimpl.checkpoint import list_checkpoints, load_latest
from refimpl.launch import WorkerError, spawn
from refimpl.train import main

BASE = [
    "--save-every",
    "2",
    "--samples",
    "64",
    "--seed",
    "3",
    "--lr",
    "0.01",
    "--progress",
    "never",
]


def _run(ckpt: Path, *extra: str, world: int = 1) -> None:
    assert spawn(main, world, [*BASE, "--ckpt-dir", str(ckpt), *extra], timeout_s=90) == [0] * world


def _refused(ckpt: Path, *extra: str, world: int = 1) -> str:
    with pytest.raises(WorkerError) as exc:
        spawn(main, world, [*BASE, "--ckpt-dir", str(ckpt), *extra], timeout_s=90)
    return str(exc.value)


def _stamps(ckpt: Path) -> dict[str, int]:
    return {d.name: (d / "MANIFEST.json").stat().st_mtime_ns for _, d in list_checkpoints(ckpt)}


@pytest.mark.timeout(170)
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--lr", "0.02"],
            "step_4 was trained at lr 0.01, not --lr 0.02: pass --lr 0.01, or "
            "--reset-lr to apply the new one",
        ),
        (
            ["--steps", "2"],
            "step_4 is past --steps 2: the run already trained 4 steps. Pass --steps 4 or more",
        ),
        (["--samples", "128"], "step_4 was trained on --samples 64, not --samples 128"),
        (
            ["--seed", "5"],
            "step_4 was trained with --seed 3 (its weights, sample order and "
            "dropout streams), not --seed 5: pass --seed 3",
        ),
    ],
)
def test_a_flag_that_contradicts_the_checkpoint_is_refused_naming_it(
    tmp_path: Path, flags: list[str], expected: str
) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, "--steps", "4")
    before = _stamps(ckpt)
    text = _refused(ckpt, "--steps", "6", *flags)
    assert expected in text and "nothing was trained" in text and "rank 0" in text, text
    assert _stamps(ckpt) == before  # no step trained, saved or pruned


@pytest.mark.timeout(170)
def test_reset_lr_applies_the_new_rate_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, "--steps", "4", "--lr-schedule", "cosine", "--warmup-steps", "2")
    args = [
        *BASE,
        "--ckpt-dir",
        str(ckpt),
        "--steps",
        "6",
        "--lr",
        "0.02",
        "--reset-lr",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
    ]
    assert spawn(main, 1, args, timeout_s=90, rank_output="show") == [0]
    out = capsys.readouterr().out
    assert "--reset-lr: step_4 was trained at lr 0.01; training on at --lr 0.02" in out, out
    found = load_latest(ckpt)
    assert found is not None and found[0] == 6
    sched, groups = found[1]["scheduler"], found[1]["optimizer"]["param_groups"]
    assert sched["base_lrs"] == [0.02] and groups[0]["initial_lr"] == 0.02
    assert groups[0]["lr"] == sched["_last_lr"][0] < 0.02  # the cosine's multiplier, on 0.02


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_sharded_resume_names_every_contradicting_flag(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, "--steps", "4", "--sharded", world=2)
    before = _stamps(ckpt)
    text = _refused(
        ckpt,
        "--sharded",
        "--steps",
        "6",
        "--lr",
        "0.02",
        "--seed",
        "5",
        "--samples",
        "128",
        world=2,
    )
    for expected in ("pass --lr 0.01, or --reset-lr", "pass --seed 3", "Pass --samples 64"):
        assert expected in text, text
    assert "sampler state has seed" not in text  # the flag, not the library's words
    assert _stamps(ckpt) == before
