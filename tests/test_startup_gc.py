"""refimpl._startup_gc: the programs torchrun restarts start without the cyclic collector and
turn it back on (frozen start-up objects) once the model is wrapped; imported, they leave it
alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_RUN_AS_PROGRAM = """
import gc, runpy, sys
sys.argv = [{module!r}, *{args!r}]
try:
    runpy.run_module({module!r}, run_name="__main__")
except SystemExit as stop:
    assert stop.code in (0, None), stop.code
print("enabled", gc.isenabled(), "frozen", gc.get_freeze_count() > 0)
"""


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()[-1]


@pytest.mark.timeout(60)
def test_pause_only_for_main_and_resume_freezes_once() -> None:
    out = _python(
        "import gc\n"
        "from refimpl import _startup_gc as s\n"
        "assert not s.pause('refimpl.train') and gc.isenabled()\n"
        "assert s.pause('__main__') and not gc.isenabled()\n"
        "s.resume(); frozen = gc.get_freeze_count()\n"
        "assert gc.isenabled() and frozen > 0\n"
        "s.resume(); assert gc.isenabled() and gc.get_freeze_count() == frozen\n"
        "gc.disable(); assert not s.pause('__main__')  # off already: not ours to turn on\n"
        "s.resume(); print('enabled', gc.isenabled())"
    )
    assert out == "enabled False"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("refimpl.train", ["--steps", "2"]),
        ("refimpl.demos.chaos_trainers", ["--steps", "2", "--step-sleep", "0"]),
    ],
)
def test_a_program_turns_the_collector_back_on_after_start_up(
    module: str, args: list[str], tmp_path: Path
) -> None:
    # each writes under tmp_path (refimpl.train's default --ckpt-dir is ./ckpt: the repository)
    out_flag = "--out" if module.endswith("chaos_trainers") else "--ckpt-dir"
    args = [*args, out_flag, str(tmp_path)]
    assert _python(_RUN_AS_PROGRAM.format(module=module, args=args)) == "enabled True frozen True"


@pytest.mark.timeout(60)
def test_importing_the_programs_leaves_the_collector_alone() -> None:
    out = _python(
        "import gc, refimpl.train, refimpl.demos.chaos_trainers\n"
        "print('enabled', gc.isenabled(), 'frozen', gc.get_freeze_count())"
    )
    assert out == "enabled True frozen 0"


@pytest.mark.timeout(60)
def test_the_file_backend_trainer_starts_without_importing_dcp() -> None:
    # torch.distributed.checkpoint costs about a CPU-second to import (DTensor, sympy), paid by
    # every worker torchrun (re)starts; only the sharded backend needs it.
    out = _python(
        "import sys\n"
        "import refimpl.train, refimpl.train._files, refimpl.checkpoint\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n"
    )
    assert out == "[]", out
