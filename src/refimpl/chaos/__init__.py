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
show that a resume forgot to restore the RNG streams (chapter 12).
"""

from __future__ import annotations

from refimpl.chaos._run import main, run_chaos
from refimpl.chaos._scenarios import DEFAULT
from refimpl.chaos._verdict import ChaosError, ChaosRow, format_table

__all__ = ["SCENARIOS", "ChaosError", "ChaosRow", "format_table", "main", "run_chaos"]

SCENARIOS = DEFAULT
"""The scenarios `run_chaos` runs by default, in order (``kill-rank0-save`` only with
``save_on``); ``resize-job`` and ``kill-in-write`` are added when their options are given."""

for _public in (ChaosError, ChaosRow, format_table, main, run_chaos):
    _public.__module__ = __name__  # documented, and shown in tracebacks, as refimpl.chaos.NAME
del _public
