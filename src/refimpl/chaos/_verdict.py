"""`refimpl.chaos`'s verdicts: a scenario's row, judged from its runs, and the errors raised
when the test itself cannot run (what the command printed, the first failing rank's traceback
first)."""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from refimpl._compare import first_difference, load_flat, tensor_distance
from refimpl._processes import Run, split_rank
from refimpl.chaos._diagnose import first_traceback, last_error, rank_report
from refimpl.chaos._scenarios import samples_check


class ChaosError(RuntimeError):
    """The test itself could not be run: the command failed before any kill, a regex never
    matched, a run timed out, or no worker with the wanted ``RANK`` was found."""


@dataclass
class ChaosRow:
    """One scenario's result: where the kill landed (the matched line), worker restarts seen
    (starts of rank 0 after the first, across the scenario's runs), the first line matching
    ``resume_on`` after the kill, whether ``FILE`` is bit-identical to the reference's, and
    if not the first differing key with its max abs difference (or what went wrong); then
    the long explanation of a failure (the first failing rank's traceback, or where each rank
    of a stalled restart was), the directory holding the scenario's logs, and what the
    comparison covered (tensors, their bytes, other values, ignored ones)."""

    scenario: str
    landed: str
    restarts: int
    resume: str | None
    equal: bool
    difference: str | None
    seconds: float
    detail: str | None = None
    log: str | None = None
    compared: str | None = None


def tail(lines: Sequence[str], n: int = 15) -> str:
    """The traceback of the first failing rank if there is one, else the last ``n`` lines."""
    if (found := first_traceback(lines)) is not None:
        rank, text = found
        head = f"    (rank {rank}'s traceback)\n" if rank is not None else ""
        return head + "\n".join(f"    {ln}" for ln in text.splitlines())
    return "\n".join(f"    {ln}" for ln in lines[-n:]) or "    (no output)"


def missed_write(name: str, run: Run, ckpt_dir: str, base: Path) -> ChaosRow:
    """kill-in-write's row when no write was caught in progress: a miss, never a pass."""
    why = (
        f"the kill missed: no file under {ckpt_dir} was seen open for writing during the "
        f"run (exit code {run.returncode}); its writes may be too short to catch, or "
        "--ckpt-dir is not where it saves"
    )
    return ChaosRow(
        name, "", 0, None, False, why, round(run.seconds, 1), log=str(base / f"{name}.logs")
    )


def check_started(run: Run, what: str, regex: str, flag: str, timeout_s: float) -> None:
    """Raise `ChaosError` unless the action fired (the run before any kill went wrong)."""
    if run.action_error is not None:
        raise ChaosError(f"{what}: at the line {run.fired!r}: {run.action_error}")
    if run.returncode is None and run.fired is None:  # a hang after the kill is the row's
        raise ChaosError(
            f"{what}: still running after --timeout {timeout_s:g} s; killed. "
            f"Its last lines:\n{tail(run.lines)}"
        )
    if run.fired is None and run.returncode != 0:
        raise ChaosError(
            f"{what}: the command failed (exit code {run.returncode}) before "
            f"the kill: no line had matched {flag} {regex!r} yet. Its last "
            f"lines:\n{tail(run.lines)}"
        )
    if run.fired is None:
        raise ChaosError(
            f"{what}: the run finished (exit code 0) without a line matching "
            f"{flag} {regex!r}, so nothing was killed. Pick a line the trainer "
            f"prints mid-run. Its last lines:\n{tail(run.lines)}"
        )


def judge_resize(
    row: ChaosRow,
    runs: list[Run],
    path: Path,
    ref_lines: list[str],
    expected: dict[str, object],
    skip: re.Pattern[str] | None,
) -> None:
    """A world-size change passes when the rerun finished, its FILE loads, and (when the
    trainer logs ``samples:`` lines) each sample was trained as often as in the reference;
    how far its tensors are from the reference's is reported, not judged."""
    if runs[-1].returncode != 0 or runs[-1].stalled is not None or len(runs) < 2:
        return  # the row already says how the rerun failed
    try:
        distance = tensor_distance(expected, load_flat(path), skip)
    except (OSError, RuntimeError, ValueError) as exc:
        row.equal, row.difference = False, f"no readable {path.name} after the resize ({exc})"
        return
    samples = samples_check(ref_lines, runs[0].lines, runs[-1].lines)
    bad = bool(samples) and not samples.startswith("samples: all")
    row.equal, row.difference = not bad, samples if bad else None
    counted = samples or "no 'samples: RANK STEP IDS' lines to count"
    row.detail = f"weights (not claimed bit-identical across world sizes): {distance}; {counted}"


def last_line(lines: Sequence[str]) -> str:
    return split_rank(lines[-1])[1].strip() if lines else "(no output)"


def judge(
    name: str,
    runs: list[Run],
    path: Path,
    reference: dict[str, object],
    resume_re: re.Pattern[str] | None,
    skip: re.Pattern[str] | None,
) -> ChaosRow:
    """Judge one scenario: how its last run ended, then its FILE against the reference."""
    first = runs[0]
    assert first.fired_at is not None
    after = first.lines[first.fired_at + 1 :] + [ln for r in runs[1:] for ln in r.lines]
    texts = (split_rank(ln)[1] for ln in after)
    resume = next((ln for ln in texts if resume_re and resume_re.search(ln)), None)
    starts = sum(len(r.rank0_pids) for r in runs)
    last = runs[-1]
    difference: str | None
    detail = None
    if last.stalled is not None:
        after_kill = "in the rerun" if len(runs) > 1 else "after the kill"
        difference = f"stalled {after_kill}: {last.stalled}"
        detail = f"{difference}; each rank:\n{rank_report(last.lines)}"
    elif name == "kill-job" and first.returncode != -signal.SIGKILL:
        n = len(first.lines)
        difference = (
            f"the kill missed: the command had already ended (exit code {first.returncode}) "
            f"when its line {first.fired_at + 1} of {n}, {first.fired!r}, arrived; pick a "
            f"--kill-on line printed mid-run, such as {first.lines[first.fired_at // 2]!r}"
        )
    elif last.returncode is None:
        difference = f"still running after the timeout (killed); last line: {last_line(last.lines)}"
    elif last.returncode != 0:
        error = last_error(last.lines) or f"last line: {last_line(last.lines)}"
        difference = f"exited {last.returncode} after the kill; {error}"
        detail = tail(last.lines)
    else:
        try:
            difference = first_difference(reference, load_flat(path), skip)
        except (OSError, RuntimeError, ValueError) as exc:
            difference = f"no readable {path.name} after the kill ({exc})"
    return ChaosRow(
        name,
        first.fired or "",
        max(starts - 1, 0),
        resume,
        difference is None,
        difference,
        round(sum(r.seconds for r in runs), 1),
        detail,
    )


CAVEAT = (
    "CAVEAT: reseeding every worker's global RNGs (torch, random, numpy) at the kill line "
    "left the result bit-identical: training after that line draws nothing from them "
    "(dropout 0, no random sampling), so a resume that forgot to restore them would pass "
    "these scenarios too. A green result here does not show that the RNG state is restored."
)


def judge_perturb(row: ChaosRow, run: Run) -> None:
    """rng-perturb passes either way once the run finished: the same result earns the caveat,
    a different one shows the RNG is drawn (so a forgotten restore would be caught)."""
    if run.returncode != 0 or run.stalled is not None:
        return  # the row already says how the run failed
    if row.equal:
        row.detail = CAVEAT
    else:
        row.detail = (
            f"reseeding the RNGs at the kill line changed the result "
            f"({row.difference}): the trainer draws from them after it, so a "
            "resume that forgot them would differ"
        )
        row.equal, row.difference = True, None


def result_text(row: ChaosRow) -> str:
    if row.scenario == "resize-job":
        return "finished" if row.equal else f"FAILED: {row.difference}"
    if row.scenario == "rng-perturb" and row.equal:
        return "CAVEAT: RNG never drawn" if row.detail == CAVEAT else "RNG drawn: good"
    return "equal" if row.equal else f"DIFFERS: {row.difference}"


def format_table(rows: Sequence[ChaosRow]) -> str:
    """The rows as a plain-text table: scenario, kill landed at, restarts, resume, result."""
    head = ("scenario", "kill landed at", "restarts", "resume line", "result")
    body = [
        (
            r.scenario,
            r.landed.strip()[:60],
            str(r.restarts),
            (r.resume or "-").strip()[:40],
            result_text(r),
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, [*widths, 0], strict=True)).rstrip()
        for line in (head, *body)
    )
