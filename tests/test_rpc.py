"""The RPC appendix shows what `refimpl.demos.rpc.rpc_tour` prints; this runs the tour and
checks the page's output block line for line."""

from __future__ import annotations

import re
from pathlib import Path

from refimpl.demos.rpc import rpc_tour
from refimpl.launch import spawn

PAGE = Path(__file__).resolve().parent.parent / "book" / "appendix_rpc.md"


def test_the_tour_prints_what_the_appendix_shows() -> None:
    caller, owner = spawn(rpc_tour, 2, timeout_s=90)
    shown = re.search(r"```text\n(.*?)```", PAGE.read_text(), re.S)
    assert shown is not None, "the appendix lost its output block"
    assert caller == shown.group(1).splitlines()
    assert owner == []  # worker1 only served calls
