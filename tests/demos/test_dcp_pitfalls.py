"""refimpl.demos.dcp_pitfalls: plain DCP's torn in-place overwrite loads a silent mix of two
saves and its crafted pickles run code; refimpl.sharded publishes nothing on the failed save
and refuses the crafted step before DCP opens it. Also what DCP itself does on an overwrite
(a UserWarning; a window with no .metadata) and on a Ctrl-C (wrapped in a BaseException)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from refimpl.demos.dcp_pitfalls import (
    crafted_metadata_demo,
    ctrl_c_demo,
    metadata_window_demo,
    overwrite_warning,
    torn_overwrite_demo,
)


@pytest.mark.timeout(60)
def test_crafted_pickles_run_under_plain_dcp_and_are_refused_by_load_sharded(
    tmp_path: Path,
) -> None:
    out = crafted_metadata_demo(tmp_path)
    for where in (".metadata", "shard item"):
        assert out[f"plain dcp.load, crafted {where}"] == (
            "returned normally, model loaded correctly: True; payload ran: True"
        )
        ours = out[f"load_sharded, crafted {where}"]
        assert ours.startswith("loaded step 1; payload ran: False; skipped step_00000002: ")
        assert "_operator.getitem" in ours
    assert "refused before DCP opened it" in out["load_sharded, crafted .metadata"]
    assert "not weights-only" in out["load_sharded, crafted shard item"]
    assert not list(tmp_path.glob("PAYLOAD_RAN_*"))  # the demo cleans up after plain DCP


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_torn_in_place_overwrite_loads_silently_mixed_and_ours_does_not(tmp_path: Path) -> None:
    lines = torn_overwrite_demo(tmp_path)
    assert lines == [
        "plain dcp.save, second save into the same directory: CheckpointException on every "
        "rank, naming rank(s) [1]; caught by `except Exception`: False",
        "plain dcp.load of that directory: no error, and it returns",
        "  0.weight: A rows 10-19, B rows 0-9",
        "  0.bias: A rows 10-19, B rows 0-9",
        "  2.weight: A rows 3-5, B rows 0-2",
        "  2.bias: A rows 3-5, B rows 0-2",
        "refimpl save_sharded, second save: ShardedCheckpointError on every rank, naming "
        "rank(s) [1]; caught by `except Exception`: True",
        "refimpl load_sharded: step 1, max |diff| vs save A: 0",
    ]


@pytest.mark.timeout(60)
def test_overwrite_raises_a_user_warning_naming_the_old_default(tmp_path: Path) -> None:
    text = overwrite_warning(tmp_path)
    assert text.startswith("UserWarning: Detected an existing checkpoint in CKPT, overwriting")
    assert "Past version 2.5 of PyTorch, `overwrite` will default to False" in text
    # torch 2.13 still defaults to True: a second save into the directory went through
    assert FileSystemWriter(tmp_path).overwrite is True


@pytest.mark.timeout(60)
def test_a_save_stopped_between_rm_file_and_rename_leaves_nothing_loadable(
    tmp_path: Path,
) -> None:
    lines = metadata_window_demo(tmp_path)
    assert lines == [
        "second save stopped (CheckpointException); the directory holds "
        "['.metadata.tmp', '__0_0.distcp']",
        "plain dcp.load: CheckpointException (no .metadata found: True); neither save A nor "
        "save B can be loaded",
    ]


@pytest.mark.timeout(60)
def test_ctrl_c_is_wrapped_by_dcp_and_stays_a_keyboard_interrupt_in_save_sharded(
    tmp_path: Path,
) -> None:
    assert ctrl_c_demo(tmp_path) == [
        "plain dcp.save: CheckpointException, carrying KeyboardInterrupt; caught by "
        "`except Exception`: False",
        "save_sharded: KeyboardInterrupt; caught by `except Exception`: False",
    ]
    assert list((tmp_path / "ckpt").iterdir()) == []  # the interrupted save left nothing
    assert "write_data" not in FileSystemWriter.__dict__  # the demo's patch is undone
