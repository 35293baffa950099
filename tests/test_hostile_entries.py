"""Crafted or unreadable entries in a checkpoint root: every listing of the steps (load, save,
the CLI, refimpl.train's start) judges each entry on its own, so one hidden name that is not a
step's cannot stop them all, and nothing it did not make is deleted."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from refimpl._publish import OWNER
from refimpl.checkpoint import list_checkpoints, load_latest, save_checkpoint

_HUGE_PID = "9" * 20  # no process has it; int() of it overflows os.kill's pid_t

CRAFTED = {
    "aside_of_dot": "...aside-00000000-1-00000000",  # base "." : Path.with_name(".") raises
    "aside_of_dotdot": "....aside-00000000-1-00000000",  # base ".."
    "aside_20_digit_pid": f".step_00000002.aside-{OWNER}-{_HUGE_PID}-00000000",
    "temp_20_digit_pid": f".step_00000003.tmp-{OWNER}-{_HUGE_PID}-00000000",
    "aside_pid_0": f".step_00000005.aside-{OWNER}-0-00000000",
}


@pytest.mark.parametrize("name", list(CRAFTED.values()), ids=list(CRAFTED))
def test_a_crafted_hidden_name_stops_no_load_save_or_listing(tmp_path: Path, name: str) -> None:
    from test_checkpoint import _cli

    save_checkpoint(tmp_path, {"w": torch.ones(2)}, 1)
    (tmp_path / name).mkdir()
    (tmp_path / name / "keep").write_text("not ours")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert load_latest(tmp_path)[0] == 1  # type: ignore[index]
    save_checkpoint(tmp_path, {"w": torch.zeros(2)}, 4, keep_last=None)
    step, state = load_latest(tmp_path)  # type: ignore[misc]
    assert step == 4 and torch.equal(state["w"], torch.zeros(2))
    code, out = _cli("list", str(tmp_path))
    assert code == 0 and out.count("verified") == 2, out
    assert (tmp_path / name / "keep").read_text() == "not ours"  # left exactly as it was


# --- python -m refimpl.checkpoint: a clear line for each entry it cannot use ---------------


def test_cli_names_symlink_loops_dangling_links_and_linked_steps(tmp_path: Path) -> None:
    """Before: a loop or a dangling link named like a step was skipped without a word (list:
    exit 0), ``inspect`` of a loop said "no COMMITTED marker", ``verify``/``list`` of one said
    "no step_N directories"; a linked step looked like any other."""
    from test_checkpoint import _cli

    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    save_checkpoint(root, {"w": torch.ones(2)}, 1)
    save_checkpoint(elsewhere, {"w": torch.ones(2)}, 2)
    (root / "step_00000002").symlink_to(elsewhere / "step_00000002")
    (root / "step_00000003").symlink_to("step_00000003")  # a loop
    (root / "step_00000004").symlink_to(tmp_path / "gone")  # to nowhere
    loop = "a symbolic link loop (it resolves back to itself)"

    code, out = _cli("list", str(root))
    lines = out.splitlines()
    assert code == 1 and len(lines) == 4, out
    assert lines[0].split()[0] == "1" and lines[0].endswith("verified"), out
    assert lines[1].endswith(f"verified (a symbolic link to {elsewhere / 'step_00000002'})")
    assert lines[2].startswith("step_00000003") and f"BAD: {loop}: not a step" in lines[2]
    assert lines[3].startswith("step_00000004")
    assert f"a symbolic link to {tmp_path / 'gone'}, which does not exist" in lines[3]

    code, out = _cli("verify", str(root))
    assert code == 1 and out.count("OK   ") == 2 and out.count("BAD  ") == 2, out
    assert f"BAD  {root / 'step_00000003'}: {loop}: not a step; remove it" in out

    for command in ("inspect", "verify", "list"):
        code, out = _cli(command, str(root / "step_00000003"))
        assert (code, out) == (1, f"{root / 'step_00000003'}: {loop}\n"), (command, out)
    code, out = _cli("inspect", str(root / "step_00000002"))  # a linked step still inspects
    assert code == 0 and "step 2" in out, out


def _without_dac_override() -> list[str]:
    """A command prefix under which permission bits apply: root bypasses them through
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, which setpriv drops from the bounding set (a
    root process's capabilities after exec)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without util-linux's setpriv: root reads any mode")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.mark.timeout(120)
def test_cli_names_what_permission_denies(tmp_path: Path) -> None:
    """Before: an unreadable directory given to list or verify ended in a PermissionError
    traceback; an unreadable step counted 0 B."""
    import subprocess
    import sys

    root = tmp_path / "ckpt"
    for step in (1, 2):
        save_checkpoint(root, {"w": torch.ones(2)}, step)
    locked = tmp_path / "locked"
    locked.mkdir()

    def cli(*args: str) -> tuple[int, str]:
        cmd = [*_without_dac_override(), sys.executable, "-m", "refimpl.checkpoint", *args]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return run.returncode, run.stdout + run.stderr

    (root / "step_00000002").chmod(0)
    locked.chmod(0)
    try:
        code, out = cli("list", str(root))
        lines = out.splitlines()
        assert code == 1 and len(lines) == 2 and "verified" in lines[0], out
        assert lines[1].split()[:3] == ["2", "?", "BAD:"] and "Permission denied" in lines[1]
        for command in ("list", "verify", "inspect"):
            code, out = cli(command, str(locked))
            assert (code, out) == (1, f"{locked}: cannot be read (Permission denied)\n"), out
    finally:
        (root / "step_00000002").chmod(0o755)
        locked.chmod(0o755)
