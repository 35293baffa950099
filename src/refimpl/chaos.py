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
- ``sigterm-job``: SIGTERM every worker at ``--kill-on`` (a preemption), then run it again;
- ``resize-job`` (with ``--resize-to N``): SIGKILL the job at ``--kill-on``, then run it again
  with torchrun's ``--nproc-per-node=N``: it must resume and finish. No bitwise claim: the row
  reports how far the weights moved and, when the trainer prints ``samples: RANK STEP
  ID,ID,...`` for each batch it trains, whether every sample was trained as often as in the
  reference (the killed run's samples before the step the rerun starts at, plus the rerun's);
  this assumes the trainer keeps its global batch across world sizes;
- ``kill-in-write`` (with ``--ckpt-dir DIR``, under ``{out}``): SIGKILL the job while one of
  its processes holds a file under ``DIR`` open for writing (seen in ``/proc``, confirmed with
  the processes stopped, so the kill provably lands inside the write; the row says which file
  and how many bytes), then run it again. A write shorter than the 5 ms look is missed, and
  the row says so (never "equal").

- ``rng-perturb`` (with ``--perturb``): no kill; at ``--kill-on`` every worker's global RNGs
  (torch's, through ``torch.manual_seed``, ``random``'s and numpy's) are reseeded at random,
  the state a resume that forgot them would leave. A result still bit-identical means the
  trainer draws nothing from them after that line (dropout 0, no random sampling): the other
  scenarios then cannot catch a forgotten RNG restore, and the row says so (a caveat, not a
  failure). The reseed is a ``SIGUSR2`` handler that chaos installs through a
  ``sitecustomize`` first on ``PYTHONPATH`` (one already there still runs after it). Its
  limits: RNGs the trainer keeps in its own ``torch.Generator`` objects and the RNGs of
  DataLoader worker processes are not reseeded; a worker that does not run the hook (``python
  -S``/``-I``, not Python) is refused; a trainer with its own ``SIGUSR2`` handler loses it.

``--help`` lists them. The last three run when their option is given.

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

import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from refimpl._chaos_cli import cli
from refimpl._chaos_compare import load_flat, summary
from refimpl._chaos_diagnose import (
    own_group_hint,
    probe_stall,
)
from refimpl._chaos_proc import RANK_PREFIX_TEMPLATE, Action, Run, run_once, split_rank
from refimpl._chaos_scenarios import (
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
from refimpl._chaos_verdict import (
    ChaosError,
    ChaosRow,
    check_started,
    format_table,
    judge,
    judge_perturb,
    judge_resize,
    missed_write,
    tail,
)

__all__ = ["SCENARIOS", "ChaosError", "ChaosRow", "format_table", "main", "run_chaos"]

ChaosError.__module__ = ChaosRow.__module__ = format_table.__module__ = __name__  # documented here

SCENARIOS = DEFAULT
"""The scenarios `run_chaos` runs by default, in order (``kill-rank0-save`` only with
``save_on``); ``resize-job`` and ``kill-in-write`` are added when their options are given."""


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
        scenarios = [*SCENARIOS, *(n for n, option in extra if option is not None)]
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
                raise ChaosError(f"--reference {reference}: no readable {compare} in it "
                                 f"({exc}); pass the {{out}} of an uninterrupted "
                                 "run") from exc  # fmt: skip
        else:
            ref = launch("reference", kill_re)
            ref_lines = ref.lines
            check_started(ref, "the reference run", kill_on, "--kill-on", timeout_s)
            if ref.returncode != 0:
                how = (f"ran past --timeout {timeout_s:g} s" if ref.returncode is None
                       else f"exited {ref.returncode}")  # fmt: skip
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
    return cli(argv, run_chaos, __doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
