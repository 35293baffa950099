"""The RPC appendix shows what `refimpl.demos.rpc` prints; this runs each demo and checks the
page's output blocks line for line (the tour, the late shutdown, the plumbing, in page order)."""

from __future__ import annotations

import re
from pathlib import Path

from refimpl.demos.rpc import late_shutdown, rpc_plumbing, rpc_tour
from refimpl.launch import spawn

PAGE = Path(__file__).resolve().parents[2] / "book" / "appendix_rpc.md"


def _shown(n: int) -> list[str]:
    """The page's n-th ```text block (indented ones included), as lines."""
    blocks = re.findall(r"^( *)```text\n(.*?)^\1```", PAGE.read_text(), re.S | re.M)
    assert len(blocks) == 3, "the appendix should show three output blocks"
    indent, body = blocks[n]
    return [line.removeprefix(indent) for line in body.splitlines()]


def test_the_tour_prints_what_the_appendix_shows() -> None:
    caller, owner = spawn(rpc_tour, 2, timeout_s=90)
    assert caller == _shown(0)
    assert owner == []  # worker1 only served calls


def test_a_graceful_shutdown_waits_past_the_rpc_timeout_as_the_appendix_shows() -> None:
    caller, other = spawn(late_shutdown, 2, 5.0, 2.0, timeout_s=90)
    assert caller == _shown(1)
    assert caller[-1].endswith("True") and other == []


def test_init_rpc_builds_what_the_appendix_shows() -> None:
    """A c10d store for rendezvous, a gloo group used during start-up and then dropped, and
    the agent's TensorPipe addresses in the store."""
    caller, other = spawn(rpc_plumbing, 2, timeout_s=90)
    assert caller == _shown(2)
    assert other == []
