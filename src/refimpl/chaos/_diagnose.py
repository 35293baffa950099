"""`refimpl.chaos`'s explanations: the first failing rank's traceback, each rank's last lines,
where each rank of a stalled restart was stuck, and the known cause of the usual stall.

A run's lines carry a rank prefix where torchrun teed them (chaos asks it to tee the workers'
stderr, with `refimpl._processes.RANK_PREFIX_TEMPLATE`): a traceback or a stack dump is then
attributed to its rank. A stalled run's workers are sent SIGABRT before the kill; with
``PYTHONFAULTHANDLER=1`` (chaos sets it) each prints its Python stack to stderr, which is
how the explanation knows a rank was stuck in ``init_process_group``.
"""

from __future__ import annotations

import re
import signal
import textwrap
import time
from collections.abc import Mapping, Sequence

from refimpl._processes import env_of, signal_all, split_rank, workers
from refimpl._system import proc

_STACK_WAIT_S = 10.0  # at most, for the aborted workers to exit (a loaded machine is slow)
_TAIL_S = 0.5  # then for torchrun's tail of their stderr (it polls every 0.1 s) to pass it on
_TAIL_MAX_S = 3.0  # or, while the launcher runs on (a restart, a slow machine), this long
_INNER = re.compile(r"^\[rank\d+\]: ?")
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_HEADS = ("Traceback (most recent call last):", "During handling", "The above exception")


def _text(line: str) -> tuple[int | None, str]:
    """A line's rank (torchrun's tee prefix) and its text, without the ``[rankN]: `` that
    torch itself puts before an uncaught exception's lines as well."""
    rank, text = split_rank(line)
    return rank, _INNER.sub("", text, count=1)


def root_cause_rank(lines: Sequence[str]) -> int | None:
    """The rank torchrun's failure summary names as the root cause (first observed failure)."""
    for i, line in enumerate(lines):
        if "Root Cause (first observed failure)" in line:
            for later in lines[i + 1 : i + 8]:
                if (m := _ROOT_RANK.search(later)) is not None:
                    return int(m.group(1))
    return None


def first_traceback(lines: Sequence[str]) -> tuple[int | None, str] | None:
    """``(rank, text)`` of the failing rank's Python traceback: the last one printed by the
    rank torchrun names as the root cause of the failure (the first rank that failed; its
    earlier tracebacks belong to attempts torchrun restarted), else the last one a worker
    printed (a rank prefix), else the last one at all; None when there is none."""
    texts = [_text(ln) for ln in lines]
    starts = [i for i, (_, t) in enumerate(texts) if t.startswith(_HEADS[0])]
    if not starts:
        return None
    root = root_cause_rank(lines)
    ranked = [i for i in starts if texts[i][0] is not None]
    mine = [i for i in ranked if texts[i][0] == root]
    at = (mine or ranked or starts)[-1]
    rank = texts[at][0]
    block: list[str] = []
    for who, text in texts[at:]:
        if who != rank:
            continue
        block.append(text)
        if text and not text[0].isspace() and not text.startswith(_HEADS) and len(block) > 1:
            break  # the exception's own line ends the traceback
    return rank, "\n".join(block)


def last_error(lines: Sequence[str]) -> str | None:
    """``rank R: Error: message`` (or ``Error: message``) of `first_traceback`, or None."""
    found = first_traceback(lines)
    if found is None:
        return None
    rank, text = found
    return (f"rank {rank}: " if rank is not None else "") + text.splitlines()[-1].strip()


def _stack(lines: list[str]) -> list[str]:
    """The frames faulthandler printed for the main thread (the block ending in <module>)."""
    blocks: list[list[str]] = []
    for text in lines:
        if text.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
        elif blocks and text.startswith("  File "):
            blocks[-1].append(text.strip())
    main = [b for b in blocks if b and b[-1].endswith("in <module>")]
    return (main or blocks or [[]])[-1]


def rank_report(lines: Sequence[str], n: int = 6) -> str:
    """For each rank that teed lines: where faulthandler says it was (innermost frames first),
    or its last ``n`` lines; then the last ``n`` lines no rank prefix claims."""
    by_rank: dict[int, list[str]] = {}
    plain: list[str] = []
    for line in lines:
        rank, text = split_rank(line)
        (plain if rank is None else by_rank.setdefault(rank, [])).append(text)
    out = []
    for rank in sorted(by_rank):
        stack = _stack(by_rank[rank])
        what = "its Python stack, innermost first" if stack else "its last stderr lines"
        shown = stack if len(stack) <= n else [*stack[: n - 2], "...", *stack[-2:]]
        shown = shown or by_rank[rank][-n:]
        out.append(f"  rank {rank} ({what}):")
        out += [f"      {ln}" for ln in shown]
    out.append("  last lines of the output:")
    out += [f"      {ln}" for ln in plain[-n:]] or ["      (none)"]
    return "\n".join(out)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has finished writing: it counts as gone)."""
    return proc.state(pid) not in (None, "Z")


def probe_stall(root: int, token: str) -> str:
    """`refimpl._processes.StallHook`: which restart the workers are in, then SIGABRT to each
    (faulthandler prints its stack), and time for torchrun's tail to pass the dumps on: until
    the launcher ends, at most `_TAIL_MAX_S` after the workers did."""
    found = workers(root)
    if not found:
        return "no worker was running (the launcher itself made no progress)"
    counts = {env_of(pid, "TORCHELASTIC_RESTART_COUNT") for pid in found.values()}
    count = counts.pop() if len(counts) == 1 else None
    signal_all(list(found.values()), signal.SIGABRT)
    deadline = time.monotonic() + _STACK_WAIT_S  # faulthandler writes, then the process ends
    while time.monotonic() < deadline and any(_alive(pid) for pid in found.values()):
        time.sleep(0.05)
    # A launcher that ends now has passed every line on; one that runs on gets more time.
    time.sleep(_TAIL_S)
    deadline = time.monotonic() + _TAIL_MAX_S - _TAIL_S
    while time.monotonic() < deadline and _alive(root):
        time.sleep(0.05)
    ranks = ", ".join(map(str, sorted(found)))
    attempt = f"restart {count} of the workers" if count not in (None, "0") else "their first start"
    return f"ranks {ranks} running, in {attempt}"


def own_group_hint(lines: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The known cause and both fixes, when a rank under torchrun was in (or failed in)
    ``init_process_group`` outside `refimpl.launch.init_from_env`; else None."""
    texts = [split_rank(ln) for ln in lines]
    under_torchrun = any(rank is not None for rank, _ in texts)
    in_init = any("init_process_group" in t for r, t in texts if r is not None)
    refimpl = any("refimpl/launch/_torchrun.py" in t for _, t in texts)  # init_from_env's file
    if not (under_torchrun and in_init) or refimpl:
        return None
    if env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return (
            "a rank was in init_process_group although TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is "
            "set: look at the peers it waits for (a rank that never started?)"
        )
    return textwrap.fill(
        "Known cause: the trainer creates its own process group (init_process_group) under "
        "torchrun, which keeps one TCPStore for all of a job's attempts; a restarted worker "
        "can read the keys the killed attempt left there and wait for peers that are gone "
        "(chapter 10; pytorch/pytorch#135712). Fix either way: give torchrun "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (here: --env "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; torchrun then makes a fresh store per attempt), "
        "or create the group with refimpl.launch.init_from_env(), which gives each attempt "
        "fresh keys.",
        width=100,
    )
