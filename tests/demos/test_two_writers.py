"""refimpl.demos.two_writers: chapter 5's two jobs in one directory, without and with the lock."""

from __future__ import annotations

from pathlib import Path

import pytest

from refimpl.demos.two_writers import two_jobs


@pytest.mark.timeout(120)
def test_chapter_5_demo_two_jobs_interleave_and_the_lock_refuses_the_second(
    tmp_path: Path,
) -> None:
    free = two_jobs(tmp_path / "free", lock=False)
    assert free.refused is None and len(free.saves) == 8
    assert "B saves step 1: step_1:B step_2:A" in free.saves  # B over A's step 1
    assert "A saves step 3: step_2:A step_3:A" in free.saves  # A pruned B's step 1
    assert (free.resumed_step, free.resumed_writer) == (4, "B")  # A's restart loads B's model
    locked = two_jobs(tmp_path / "locked", lock=True)
    assert locked.refused is not None and "is in use by another run" in locked.refused
    assert locked.refusal_names_a and "host <host>, pid <A's pid> holds" in locked.refused
    assert all(line.startswith("A saves") for line in locked.saves) and len(locked.saves) == 4
    assert (locked.resumed_step, locked.resumed_writer) == (4, "A")
