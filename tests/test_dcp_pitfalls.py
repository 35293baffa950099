"""refimpl.demos.dcp_pitfalls: plain DCP's torn in-place overwrite loads a silent mix of two
saves and its crafted pickles run code; refimpl.sharded publishes nothing on the failed save
and refuses the crafted step before DCP opens it."""

from __future__ import annotations

from pathlib import Path

import pytest

from refimpl.demos.dcp_pitfalls import crafted_metadata_demo, torn_overwrite_demo


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
