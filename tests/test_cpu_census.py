"""tools/cpu_census.py: a command's CPU by process kind, with how busy the cores were."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers.scripts import load_script

cpu_census = load_script("tools/cpu_census.py")

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)"),
]

# Two children that each spin for 1.5 s of CPU, one of them an orphan: its parent exits at
# once, so the command's own accounting (what `time` reports) never sees it.
_SPIN = (
    "import time; t = time.process_time(); all(iter(lambda: time.process_time() - t < 1.5, False))"
)
_PARENT = f"""
import subprocess, sys, time
spin = {_SPIN!r}
waited = subprocess.Popen([sys.executable, "-c", spin])
orphan_parent = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys; subprocess.Popen([sys.executable, '-c', {_SPIN!r}])"])
orphan_parent.wait()
waited.wait()
time.sleep(2.5)  # the orphan ends meanwhile
sys.exit(3)
"""


def test_counts_every_process_started_even_an_orphan_and_keeps_the_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "census.json"
    status = cpu_census.main(
        ["--every", "0.1", "--json", str(out), "--", sys.executable, "-c", _PARENT]
    )
    assert status == 3
    rows = json.loads(out.read_text())
    spins = [cpu for _, cmd, cpu in rows["processes"] if "-c import time" in cmd]
    # the waited-for child and the orphan, each with (nearly) its 1.5 s: a sample may miss
    # the last 0.1 s
    assert len(spins) == 2 and all(1.3 <= cpu <= 3.0 for cpu in spins), rows
    assert 0.0 < rows["busy"] <= 1.0
    report = capsys.readouterr().err
    assert "cores busy" in report and "python -c" in report


@pytest.mark.parametrize(
    ("cmd", "expected"),
    [
        ("/v/bin/python /v/bin/torchrun --standalone -m refimpl.train", "torchrun"),
        ("/v/bin/python -u -m refimpl.train --steps 3", "python -m refimpl.train"),
        (
            "/v/bin/python -Xfrozen_modules=off -m ipykernel_launcher -f k.json",
            "python -m ipykernel_launcher",
        ),
        (
            "/v/bin/python -X frozen_modules=off -m ipykernel_launcher",
            "python -m ipykernel_launcher",
        ),
        ("/v/bin/python -u train_gpt.py --out x", "python train_gpt.py"),
        ("/v/bin/python -c import sys", "python -c"),
        ("/usr/bin/make test", "make"),
        ("", "(no command line)"),
    ],
)
def test_kind_names_the_program_module_or_script(cmd: str, expected: str) -> None:
    assert cpu_census.kind(cmd) == expected


def test_no_command_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cpu_census.main(["--"])
    assert exit_.value.code == 2
    assert "give the command to run after --" in capsys.readouterr().err
