"""Chapter 10: the kill test for any trainer. Does it finish bit-identical after a kill?

::

    python -m refimpl.chaos --kill-on 'step 7 loss' --save-on 'saving step 10' \\
        --compare final.pt --json chaos.json -- \\
        torchrun --standalone --nproc-per-node=2 --max-restarts=2 my_train.py --out {out}

The command runs once uninterrupted (the reference), then once per scenario, each time with
``{out}`` (anywhere in its arguments) replaced by a fresh directory:

- ``kill-rank1``: SIGKILL the worker the launcher gave ``RANK=1`` at the first line
  matching ``--kill-on`` (a ``RANK`` a job script exported, inherited unchanged by a wrapper
  and the launcher, does not count); torchrun restarts the workers (give it ``--max-restarts``);
- ``kill-rank0-save``: SIGKILL rank 0 at the first line matching ``--save-on`` (print one
  just before a save starts, so the kill lands in it); only with ``--save-on``;
- ``kill-job``: SIGKILL every process of the command at ``--kill-on``, then run it again (a
  command that had ended before the kill landed fails the row: "the kill missed");
- ``sigterm-job``: SIGTERM every worker at ``--kill-on`` (a preemption), then run it again.

Then ``FILE`` (relative to ``{out}``; a ``torch.save`` file, loaded weights-only, or a
``.safetensors`` file) of each scenario is compared with the reference's, tensor by tensor and
bit for bit; the exit status is 0 only when every scenario matches. ``--reference DIR`` reuses
an earlier uninterrupted run's ``{out}`` instead of running the reference again. Workers are
found through ``/proc`` (Linux). The command runs with ``PYTHONUNBUFFERED=1``, so its lines
arrive as they are printed and a kill lands where its line says; ``--env K=V`` adds to its
environment (the command is otherwise run as given: test it as it runs in production).

Nothing hangs and every failure is explained: every run has a ``--timeout``, every process a
run started is killed when it ends, and a restart that prints nothing for ``--stall`` seconds
(default 30) ends its scenario with each rank's Python stack (the workers print it on
SIGABRT: chaos sets ``PYTHONFAULTHANDLER=1``) and, when a rank was stuck in its own
``init_process_group`` under torchrun, the known cause and both fixes. A failed run's row
shows the first failing rank's traceback: chaos asks torchrun (through its ``PET_TEE``,
``PET_LOG_DIR`` and ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` variables, unless set) to tee
each worker's stderr with a ``[rankN]:`` prefix, which chaos takes off before matching. A
line printed to stderr (``logging``'s default) reaches chaos through that tee, a fraction of a
second late: print the ``--save-on`` line to stdout. Every run's output is kept in
``WORK/SCENARIO.logs/`` (named in the report; without ``--work`` a failed test keeps its
temporary directory).

The trainer must resume by itself (find its newest checkpoint at start) and be deterministic
for a given seed (the reference run is compared with runs on the same machine), and it should
draw from its RNG while training (dropout, random batches): a run that draws nothing cannot
show that a resume forgot to restore the RNG streams (chapter 11).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from refimpl._argtypes import int_range
from refimpl._chaos_compare import first_difference, load_flat, summary
from refimpl._chaos_diagnose import (
    first_traceback,
    last_error,
    own_group_hint,
    probe_stall,
    rank_report,
)
from refimpl._chaos_proc import (
    RANK_PREFIX_TEMPLATE,
    Action,
    Run,
    kill_run,
    run_once,
    signal_all,
    split_rank,
    workers,
)

__all__ = ["SCENARIOS", "ChaosError", "ChaosRow", "format_table", "main", "run_chaos"]

SCENARIOS = ("kill-rank1", "kill-rank0-save", "kill-job", "sigterm-job")
"""The scenarios `run_chaos` runs, in order (``kill-rank0-save`` only with ``save_on``)."""
_RERUN = ("kill-job", "sigterm-job")  # the job is gone: recovery is running the command again


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


def _tail(lines: Sequence[str], n: int = 15) -> str:
    """The traceback of the first failing rank if there is one, else the last ``n`` lines."""
    if (found := first_traceback(lines)) is not None:
        rank, text = found
        head = f"    (rank {rank}'s traceback)\n" if rank is not None else ""
        return head + "\n".join(f"    {ln}" for ln in text.splitlines())
    return "\n".join(f"    {ln}" for ln in lines[-n:]) or "    (no output)"


def _kill_rank(rank: int, sig: int) -> Action:
    def act(root: int, token: str) -> str | None:
        pid = workers(root, until=lambda found: rank in found).get(rank)
        if pid is None:
            return (f"no process with RANK={rank} among the command's descendants: is it a "
                    "torchrun (or similar launcher) with at least two workers?")  # fmt: skip
        signal_all([pid], sig)
        return None

    return act


def _kill_job(root: int, token: str) -> str | None:
    kill_run(root, token)
    return None


def _sigterm_workers(root: int, token: str) -> str | None:
    found = workers(root, until=bool)
    if not found:
        return "no process with RANK=... among the command's descendants: who is a worker?"
    signal_all(list(found.values()), signal.SIGTERM)
    return None


def _check_started(run: Run, what: str, regex: str, flag: str, timeout_s: float) -> None:
    """Raise `ChaosError` unless the action fired (the run before any kill went wrong)."""
    if run.action_error is not None:
        raise ChaosError(f"{what}: at the line {run.fired!r}: {run.action_error}")
    if run.returncode is None and run.fired is None:  # a hang after the kill is the row's
        raise ChaosError(f"{what}: still running after --timeout {timeout_s:g} s; killed. "
                         f"Its last lines:\n{_tail(run.lines)}")  # fmt: skip
    if run.fired is None and run.returncode != 0:
        raise ChaosError(f"{what}: the command failed (exit code {run.returncode}) before "
                         f"the kill: no line had matched {flag} {regex!r} yet. Its last "
                         f"lines:\n{_tail(run.lines)}")  # fmt: skip
    if run.fired is None:
        raise ChaosError(f"{what}: the run finished (exit code 0) without a line matching "
                         f"{flag} {regex!r}, so nothing was killed. Pick a line the trainer "
                         f"prints mid-run. Its last lines:\n{_tail(run.lines)}")  # fmt: skip


def run_chaos(
    cmd: Sequence[str],
    *,
    kill_on: str,
    compare: str,
    save_on: str | None = None,
    resume_on: str = r"(?i)\bresum(ed|ing)\b",
    scenarios: Sequence[str] = SCENARIOS,
    timeout_s: float = 300.0,
    work: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    log: Callable[[str], None] | None = None,
    jobs: int = 1,
    reference: str | os.PathLike[str] | None = None,
    stall_s: float = 30.0,
    ignore: Sequence[str] = (),
) -> list[ChaosRow]:
    """Run the reference, then each scenario of ``scenarios``; return one `ChaosRow` each.

    ``cmd`` is the command line with ``{out}`` in it; ``compare`` the file to compare,
    relative to ``{out}``; ``kill_on``/``save_on``/``resume_on`` are regular expressions
    searched in each output line. ``work`` is where the ``{out}`` directories go (kept;
    default a temporary directory, removed); ``env`` is added to this process's environment
    for the command, which also gets ``PYTHONUNBUFFERED=1`` (its lines arrive as printed) and
    a marker that finds its processes, and asks torchrun (through its ``PET_`` variables,
    unless ``env`` sets them) to tee each worker's stderr with a rank prefix into
    ``WORK/NAME.logs/torchrun`` and to print a worker's stack on SIGABRT
    (``PYTHONFAULTHANDLER=1``). Each run's output is kept in ``WORK/NAME.logs/output-N.log``.
    After a kill, a restart that prints nothing for ``stall_s`` seconds (or twice the
    reference's longest silence, if longer) is a stall: each worker's stack is taken, the run
    is killed and its row explains it. ``log`` gets one line per finished run. ``jobs``
    scenarios run at a time, after the reference (side by side, each row's seconds grow). Raises
    `ChaosError` when the test cannot be run (see its docstring); a trainer that fails to
    recover (a wrong result, a failed or hung restart) is a row with ``equal=False``.

    ``reference`` is the ``{out}`` directory of an earlier uninterrupted run of the same
    command (for example ``WORK/reference`` of a previous call): its ``compare`` file is the
    reference and no reference run is made. An empty ``scenarios`` runs only the reference.
    ``ignore`` lists keys of ``compare`` (dotted, as the rows name them) or regular
    expressions matching whole keys, left out of the comparison with everything under them
    (a path, a timestamp); one that matches no key of the reference is an error.
    Without ``work``, the temporary directory is kept (and named in the rows and errors) when
    a scenario fails or the test cannot run.
    """
    if unknown := [s for s in scenarios if s not in SCENARIOS]:
        raise ChaosError(f"unknown scenarios {unknown} (known: {', '.join(SCENARIOS)})")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ChaosError(f"jobs must be a whole number >= 1, not {jobs!r}")
    if not any("{out}" in a for a in cmd):
        raise ChaosError("the command has no {out}: where would each run write?")
    try:
        kill_re, save_re, resume_re = (re.compile(r) if r else None
                                       for r in (kill_on, save_on, resume_on))  # fmt: skip
    except re.error as exc:
        raise ChaosError(f"not a regular expression: {exc.pattern!r} ({exc})") from exc
    skip = _ignore_pattern(ignore)
    base = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix="chaos-"))
    if work is not None and base.exists() and any(base.iterdir()):
        raise ChaosError(f"--work {base} is not empty: pick an empty or new directory")
    full_env = {**os.environ, **(env or {})}
    say = log or (lambda _: None)
    silence = [stall_s]  # raised to twice the reference's longest silence, once it is known
    passed = False

    def launch(
        name: str,
        trigger: re.Pattern[str] | None = None,
        action: Action | None = None,
        *,
        stall: bool = False,
        rerun: bool = False,
    ) -> Run:
        out, logs = base / name, base / f"{name}.logs"
        out.mkdir(parents=True, exist_ok=True)
        logs.mkdir(exist_ok=True)
        run_env = {**_diagnostic_env(logs / "torchrun"), **full_env}
        run = run_once(
            [a.replace("{out}", str(out)) for a in cmd],
            env=run_env,
            timeout_s=timeout_s,
            trigger=trigger,
            action=action,
            stall_s=silence[0] if stall else None,
            stall_from_start=rerun,
            on_stall=probe_stall,
        )
        number = len(list(logs.glob("output-*.log"))) + 1
        (logs / f"output-{number}.log").write_text("".join(f"{ln}\n" for ln in run.lines))
        say(f"{name}: exit code {run.returncode}, {run.seconds:.1f} s")
        return run

    try:
        if reference is not None:
            try:
                expected = load_flat(Path(reference) / compare)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ChaosError(f"--reference {reference}: no readable {compare} in it "
                                 f"({exc}); pass the {{out}} of an uninterrupted "
                                 "run") from exc  # fmt: skip
        else:
            ref = launch("reference", kill_re)
            _check_started(ref, "the reference run", kill_on, "--kill-on", timeout_s)
            if ref.returncode != 0:
                how = (f"ran past --timeout {timeout_s:g} s" if ref.returncode is None
                       else f"exited {ref.returncode}")  # fmt: skip
                raise ChaosError(f"the reference run (no kill) {how}. Its last lines:\n"
                                 f"{_tail(ref.lines)}")  # fmt: skip
            texts = [split_rank(ln)[1] for ln in ref.lines]
            if save_re is not None and not any(save_re.search(t) for t in texts):
                raise ChaosError(f"the reference run printed no line matching --save-on "
                                 f"{save_on!r}. Its last lines:\n{_tail(ref.lines)}")  # fmt: skip
            try:
                expected = load_flat(base / "reference" / compare)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ChaosError(f"the reference run wrote no readable {compare} under {{out}} "
                                 f"({base / 'reference'}): {exc}") from exc  # fmt: skip
            silence[0] = max(stall_s, 2 * ref.max_gap_s)
        for pattern in ignore:
            one = _ignore_pattern([pattern])
            if one is not None and not any(one.fullmatch(k) for k in expected if k):
                raise ChaosError(
                    f"--ignore {pattern!r} matches no key of the reference's "
                    f"{compare} (its keys: {', '.join(k for k in expected if k)[:300]})"
                )
        covered = summary(expected, skip)

        def scenario(name: str) -> ChaosRow:
            on_save = name == "kill-rank0-save"
            action = {"kill-rank1": _kill_rank(1, signal.SIGKILL),
                      "kill-rank0-save": _kill_rank(0, signal.SIGKILL),
                      "kill-job": _kill_job, "sigterm-job": _sigterm_workers}[name]  # fmt: skip
            runs = [launch(name, save_re if on_save else kill_re, action, stall=True)]
            flag, regex = ("--save-on", str(save_on)) if on_save else ("--kill-on", kill_on)
            _check_started(runs[0], f"scenario {name}", regex, flag, timeout_s)
            if name in _RERUN and runs[0].stalled is None:
                runs.append(launch(name, stall=True, rerun=True))
            row = _row(name, runs, base / name / compare, expected, resume_re, skip)
            row.log, row.compared = str(base / f"{name}.logs"), covered
            if row.detail is not None and (hint := own_group_hint(runs[-1].lines, full_env)):
                row.detail += "\n" + hint
            return row

        todo = [n for n in scenarios if n != "kill-rank0-save" or save_re is not None]
        # Scenarios are independent (own {out}, own marker): side by side they overlap the
        # time each spends waiting for torchrun to notice, restart and rendezvous.
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="chaos") as pool:
            rows = list(pool.map(scenario, todo))
        passed = all(r.equal for r in rows)
        return rows
    except ChaosError as exc:
        if work is None:
            raise ChaosError(f"{exc}\n(the runs' logs are kept under {base})") from exc
        raise
    finally:
        if work is None and passed:
            shutil.rmtree(base, ignore_errors=True)


def _ignore_pattern(keys: Sequence[str]) -> re.Pattern[str] | None:
    """One pattern for ``--ignore``'s keys: each matches as written or as a regex (whole)."""
    if not keys:
        return None
    parts = [re.escape(k) for k in keys]
    for k in keys:
        try:
            re.compile(k)
        except re.error:
            continue
        parts.append(f"(?:{k})")
    return re.compile("|".join(parts))


def _diagnostic_env(log_dir: Path) -> dict[str, str]:
    """What chaos adds to a run's environment to explain a failure: torchrun tees each
    worker's stderr (not stdout: a tee is a tail of a file, later than the line) with a rank
    prefix into ``log_dir``, and a worker prints its stack on SIGABRT."""
    return {
        "PET_TEE": "2",
        "PET_LOG_DIR": str(log_dir),
        "PYTHONFAULTHANDLER": "1",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": RANK_PREFIX_TEMPLATE,
    }


def _last(lines: Sequence[str]) -> str:
    return split_rank(lines[-1])[1].strip() if lines else "(no output)"


def _row(name: str, runs: list[Run], path: Path, reference: dict[str, object],
         resume_re: re.Pattern[str] | None, skip: re.Pattern[str] | None) -> ChaosRow:  # fmt: skip
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
        difference = f"still running after the timeout (killed); last line: {_last(last.lines)}"
    elif last.returncode != 0:
        error = last_error(last.lines) or f"last line: {_last(last.lines)}"
        difference = f"exited {last.returncode} after the kill; {error}"
        detail = _tail(last.lines)
    else:
        try:
            difference = first_difference(reference, load_flat(path), skip)
        except (OSError, RuntimeError, ValueError) as exc:
            difference = f"no readable {path.name} after the kill ({exc})"
    return ChaosRow(name, first.fired or "", max(starts - 1, 0), resume, difference is None,
                    difference, round(sum(r.seconds for r in runs), 1), detail)  # fmt: skip


def format_table(rows: Sequence[ChaosRow]) -> str:
    """The rows as a plain-text table: scenario, kill landed at, restarts, resume, result."""
    head = ("scenario", "kill landed at", "restarts", "resume line", "result")
    body = [(r.scenario, r.landed.strip()[:60], str(r.restarts), (r.resume or "-").strip()[:40],
             "equal" if r.equal else f"DIFFERS: {r.difference}") for r in rows]  # fmt: skip
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, [*widths, 0], strict=True)).rstrip()
                     for line in (head, *body))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m refimpl.chaos [options] -- CMD...``: 0 when every scenario matches, 1 when
    one differs, 2 when the test could not run (`ChaosError`, printed)."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args_in:
        args_in.append("--")
    split = args_in.index("--")
    p = argparse.ArgumentParser(prog="python -m refimpl.chaos", usage="%(prog)s [options] -- CMD",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--kill-on", required=True, help="regex: kill at the first line it matches")
    p.add_argument("--save-on", help="regex: a line printed as a save starts (kill rank 0)")
    p.add_argument(
        "--compare",
        required=True,
        help="under {out}: a torch.save file, a .safetensors file or a DCP "
        "directory, compared bit for bit",
    )
    p.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="KEY_OR_REGEX",
        help="leave this key of FILE (dotted, as the report names it; or a regex "
        "matching whole keys) out of the comparison: a path, a timestamp "
        "(repeatable)",
    )
    p.add_argument(
        "--resume-on",
        default=r"(?i)\bresum(ed|ing)\b",
        help="regex of the trainer's resume line (default: 'resumed'/'resuming')",
    )
    p.add_argument("--json", help="write the rows here as JSON")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument(
        "--stall",
        type=float,
        default=30.0,
        help="seconds without a line after a kill that make a restart a stall "
        "(default 30; at least twice the reference's longest silence)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="add K=V to the command's environment in every run (repeatable)",
    )
    p.add_argument("--work", help="keep the runs' directories here (default: a temporary one)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    p.add_argument(
        "--reference",
        help="the {out} of an earlier uninterrupted run of the same command: compare with its "
        "FILE instead of running the reference again",
    )
    p.add_argument(
        "--jobs",
        type=int_range(1),
        default=1,
        help="scenarios run side by side after the reference (default 1)",
    )
    args = p.parse_args(args_in[:split])
    cmd = args_in[split + 1 :]
    if not cmd:
        p.error("no command: put it after --, with {out} where each run writes")
    if bad := [e for e in args.env if "=" not in e or e.startswith("=")]:
        p.error(f"--env wants K=V, not {bad[0]!r}")
    extra = dict(e.split("=", 1) for e in args.env)
    start = time.monotonic()
    try:
        rows = run_chaos(cmd, kill_on=args.kill_on, compare=args.compare, save_on=args.save_on,
                         resume_on=args.resume_on,
                         scenarios=[s for s in args.scenarios.split(",") if s],
                         timeout_s=args.timeout, work=args.work, jobs=args.jobs,
                         reference=args.reference, stall_s=args.stall, env=extra,
                         ignore=args.ignore,
                         log=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
    except ChaosError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if rows and rows[0].compared:
        print(f"compared {args.compare}: {rows[0].compared}")
    for row in rows:
        if not row.equal:
            print(f"\n{row.scenario}: {row.detail or row.difference}\n  logs: {row.log}")
    print(f"{sum(r.equal for r in rows)}/{len(rows)} scenarios bit-identical to the reference "
          f"({time.monotonic() - start:.0f} s)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0 if all(r.equal for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
