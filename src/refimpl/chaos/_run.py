"""`refimpl.chaos`'s runner: the reference run, then each scenario, each judged (`run_chaos`),
and the command line's entry point (`main`). The package's docstring says what each scenario
does and what the trainer must do."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from refimpl._compare import load_flat, summary
from refimpl._processes import RANK_PREFIX_TEMPLATE, Action, Run, run_once, split_rank
from refimpl.chaos._cli import cli
from refimpl.chaos._diagnose import (
    own_group_hint,
    probe_stall,
)
from refimpl.chaos._scenarios import (
    DEFAULT,
    RERUN,
    WHAT,
    kill_job,
    kill_rank,
    perturb_env,
    reseed_workers,
    resized,
    sigterm_workers,
    write_watch,
)
from refimpl.chaos._verdict import (
    ChaosError,
    ChaosRow,
    check_started,
    judge,
    judge_perturb,
    judge_resize,
    missed_write,
    tail,
)

DESCRIPTION = (
    "Chapter 10: the kill test for any trainer. Does it finish bit-identical after a kill?"
)
"""The first line of ``--help``."""


def run_chaos(
    cmd: Sequence[str],
    *,
    kill_on: str,
    compare: str,
    save_on: str | None = None,
    resume_on: str = r"(?i)\bresum(ed|ing)\b",
    scenarios: Sequence[str] | None = None,
    timeout_s: float = 300.0,
    work: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    log: Callable[[str], None] | None = None,
    jobs: int = 1,
    reference: str | os.PathLike[str] | None = None,
    stall_s: float = 30.0,
    ignore: Sequence[str] = (),
    resize_to: int | None = None,
    ckpt_dir: str | None = None,
    perturb: bool = False,
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
    ``scenarios`` defaults to `SCENARIOS`, plus ``resize-job`` with ``resize_to`` (the rerun's
    ``--nproc-per-node``), ``kill-in-write`` with ``ckpt_dir`` (under ``{out}``) and
    ``rng-perturb`` with ``perturb`` (the module's docstring says what each does); naming one
    without its option raises `ChaosError`.
    Without ``work``, the temporary directory is kept (and named in the rows and errors) when
    a scenario fails or the test cannot run.
    """
    if scenarios is None:
        extra = [
            ("resize-job", resize_to),
            ("kill-in-write", ckpt_dir),
            ("rng-perturb", perturb or None),
        ]
        scenarios = [*DEFAULT, *(n for n, option in extra if option is not None)]
    if unknown := [s for s in scenarios if s not in WHAT]:
        raise ChaosError(f"unknown scenarios {unknown} (known: {', '.join(WHAT)})")
    resize_cmd = resized(cmd, resize_to) if resize_to is not None else None
    if "resize-job" in scenarios and resize_cmd is None:
        raise ChaosError(
            "resize-job needs --resize-to N and a command with torchrun's --nproc-per-node "
            "(the rerun gets N workers instead)"
        )
    if "kill-in-write" in scenarios and ckpt_dir is None:
        raise ChaosError(
            "kill-in-write needs --ckpt-dir: the directory under {out} where the trainer "
            "writes its checkpoints"
        )
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ChaosError(f"jobs must be a whole number >= 1, not {jobs!r}")
    if not any("{out}" in a for a in cmd):
        raise ChaosError("the command has no {out}: where would each run write?")
    try:
        kill_re, save_re, resume_re = (
            re.compile(r) if r else None for r in (kill_on, save_on, resume_on)
        )
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
        watch: bool = False,
        command: Sequence[str] = cmd,
    ) -> Run:
        out, logs = base / name, base / f"{name}.logs"
        out.mkdir(parents=True, exist_ok=True)
        logs.mkdir(exist_ok=True)
        run_env = {**_diagnostic_env(logs / "torchrun"), **full_env}
        if name == "rng-perturb":
            run_env.update(perturb_env(logs / "hook", run_env))
        run = run_once(
            [a.replace("{out}", str(out)) for a in command],
            env=run_env,
            timeout_s=timeout_s,
            trigger=trigger,
            action=action,
            stall_s=silence[0] if stall else None,
            stall_from_start=rerun,
            on_stall=probe_stall,
            watch=write_watch(out / str(ckpt_dir)) if watch else None,
        )
        number = len(list(logs.glob("output-*.log"))) + 1
        (logs / f"output-{number}.log").write_text("".join(f"{ln}\n" for ln in run.lines))
        say(f"{name}: exit code {run.returncode}, {run.seconds:.1f} s")
        return run

    try:
        if reference is not None:
            try:
                expected = load_flat(Path(reference) / compare)
                kept_log = Path(reference).parent / "reference.logs" / "output-1.log"
                ref_lines = kept_log.read_text().splitlines() if kept_log.is_file() else []
            except (OSError, RuntimeError, ValueError) as exc:
                raise ChaosError(
                    f"--reference {reference}: no readable {compare} in it "
                    f"({exc}); pass the {{out}} of an uninterrupted "
                    "run"
                ) from exc
        else:
            ref = launch("reference", kill_re)
            ref_lines = ref.lines
            check_started(ref, "the reference run", kill_on, "--kill-on", timeout_s)
            if ref.returncode != 0:
                how = (
                    f"ran past --timeout {timeout_s:g} s"
                    if ref.returncode is None
                    else f"exited {ref.returncode}"
                )
                raise ChaosError(
                    f"the reference run (no kill) {how}. Its last lines:\n{tail(ref.lines)}"
                )
            texts = [split_rank(ln)[1] for ln in ref.lines]
            if save_re is not None and not any(save_re.search(t) for t in texts):
                raise ChaosError(
                    f"the reference run printed no line matching --save-on "
                    f"{save_on!r}. Its last lines:\n{tail(ref.lines)}"
                )
            try:
                expected = load_flat(base / "reference" / compare)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ChaosError(
                    f"the reference run wrote no readable {compare} under {{out}} "
                    f"({base / 'reference'}): {exc}"
                ) from exc
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
            on_save, in_write = name == "kill-rank0-save", name == "kill-in-write"
            actions: dict[str, Action] = {
                "kill-rank1": kill_rank(1, signal.SIGKILL),
                "kill-rank0-save": kill_rank(0, signal.SIGKILL),
                "sigterm-job": sigterm_workers,
                "rng-perturb": reseed_workers,
            }
            trigger = None if in_write else save_re if on_save else kill_re
            action = None if in_write else actions.get(name, kill_job)
            runs = [launch(name, trigger, action, stall=True, watch=in_write)]
            if in_write and runs[0].fired is None:
                return missed_write(name, runs[0], str(ckpt_dir), base)
            flag, regex = ("--save-on", str(save_on)) if on_save else ("--kill-on", kill_on)
            check_started(runs[0], f"scenario {name}", regex, flag, timeout_s)
            if name in RERUN and runs[0].stalled is None:
                again = resize_cmd if name == "resize-job" and resize_cmd else cmd
                runs.append(launch(name, stall=True, rerun=True, command=again))
            row = judge(name, runs, base / name / compare, expected, resume_re, skip)
            if name == "rng-perturb":
                judge_perturb(row, runs[0])
            if name == "resize-job":
                judge_resize(row, runs, base / name / compare, ref_lines, expected, skip)
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m refimpl.chaos [options] -- CMD...`` (``--help`` lists the scenarios): 0
    when every scenario passes, 1 when one fails, 2 when the test could not run
    (`ChaosError`, printed)."""
    return cli(argv, run_chaos, DESCRIPTION)
