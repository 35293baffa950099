"""Chapter 5: kill the saver at random moments, then check what the next run can load.

`kill_trials` starts a child process that saves one step after another (resuming where the
previous child stopped, like a restarted trainer), SIGKILLs it at a random moment, and then
checks what is on disk the way the next run would read it. Three writers are compared:

- ``"plain"``: ``torch.save(state, "ckpt.pt")``, the code most trainers ship;
- ``"atomic"``: `refimpl.atomic.atomic_save` to the same single file;
- ``"checkpoint"``: `refimpl.checkpoint.save_checkpoint` + `load_latest`;
- ``"async"``: `refimpl.checkpoint.AsyncCheckpointer` + `load_latest`: a save counts as
  returned once the next ``save`` (which waits for it) returns, i.e. once it is committed.

After every kill the loaded state must be complete (it loads), equal to a state some save
wrote, and no older than the last save that *returned*. Run ``python -m refimpl.demos.faults
--kills 500`` for the long run. The disk failing instead (ENOSPC, EIO, a flipped bit) is
`refimpl.demos.io_faults`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from refimpl import atomic
from refimpl.checkpoint import AsyncCheckpointer, load_latest, save_checkpoint
from refimpl.launch._rank import main_module_hidden

__all__ = [
    "MODES",
    "KillReport",
    "kill_trials",
    "main",
    "make_state",
]

MODES = ("plain", "atomic", "checkpoint", "async")
"""The writers `kill_trials` can put under fire."""


def make_state(step: int, numel: int = 1 << 18) -> dict[str, Any]:
    """The state saved at ``step``: every value is derived from ``step``, so it is checkable."""
    return {"model": {"w": torch.full((numel,), float(step))}, "meta": {"step": step}}


def _matches(state: Any, step: int, numel: int) -> bool:
    try:
        return bool(
            state["meta"]["step"] == step
            and state["model"]["w"].shape == (numel,)
            and torch.equal(state["model"]["w"], torch.full((numel,), float(step)))
        )
    except (KeyError, TypeError, AttributeError):
        return False


def _saver_child(mode: str, directory: str, start: int, numel: int, conn: Any) -> None:
    """Child: save steps start, start+1, ... forever; report each step after it returns."""
    torch.set_num_threads(1)
    path = Path(directory, "ckpt.pt")
    conn.send(-1)  # ready: the parent starts its kill timer now
    step = start
    saver = AsyncCheckpointer(directory, keep_last=2) if mode == "async" else None
    while True:
        state = make_state(step, numel)
        if saver is not None:
            saver.save(state, step)  # returns once step - 1 is committed and step is staged
            if step > start:
                conn.send(step - 1)
            step += 1
            continue
        if mode == "plain":
            torch.save(state, path)
        elif mode == "atomic":
            atomic.atomic_save(state, path)
        else:
            save_checkpoint(directory, state, step, keep_last=2)
        conn.send(step)
        step += 1


@dataclass
class KillReport:
    """What `kill_trials` found. ``torn`` counts kills after which the next run could not load
    a complete, saved state; ``stale`` counts loads older than the last returned save."""

    mode: str
    kills: int = 0
    torn: int = 0
    stale: int = 0
    skipped: int = 0  # checkpoint and async modes: steps load_latest had to skip (stays 0)
    saves_returned: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no kill left a torn, stale or skipped checkpoint."""
        return self.torn == 0 and self.stale == 0 and self.skipped == 0


def _check(mode: str, directory: Path, last: int, numel: int, report: KillReport) -> None:
    """Read ``directory`` as the next run would; count what is wrong with it."""
    problems: list[str] = []
    if mode in ("checkpoint", "async"):
        found = load_latest(directory, on_skip=lambda d, why: problems.append(f"skip {why}"))
        report.skipped += len(problems)
        step, state = found if found is not None else (0, None)
    else:
        try:
            state = torch.load(directory / "ckpt.pt", map_location="cpu", weights_only=True)
            step = int(state["meta"]["step"])
        except FileNotFoundError:
            step, state = 0, None
        except Exception as exc:  # a torn zip raises several types
            report.torn += 1
            detail = (str(exc) or "file is empty or cut short").splitlines()[0][:100]
            problems.append(f"torn: {type(exc).__name__}: {detail}")
            step, state = -1, None
    if step > 0 and not _matches(state, step, numel):
        report.torn += 1
        problems.append(f"step {step} loads but differs from what was saved")
    elif step >= 0 and step < last:
        report.stale += 1
        problems.append(f"loaded step {step}, but step {last} had returned")
    if problems and len(report.examples) < 5:
        report.examples.append(f"kill {report.kills}: {problems[0]}")


def kill_trials(
    mode: str,
    directory: str | os.PathLike[str],
    kills: int,
    *,
    seed: int = 0,
    max_delay_s: float = 0.15,
    numel: int = 1 << 18,
    progress: bool = False,
) -> KillReport:
    """SIGKILL a saving child ``kills`` times at random moments; check the disk after each.

    Every child resumes at the step after the last save that returned, as a restarted
    trainer would; the kill lands uniformly in ``[0, max_delay_s]`` after the child is
    ready (``seed`` fixes the schedule, not the outcome: the disk is faster some runs).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "refimpl.demos.faults"])
    rng = random.Random(seed)
    report = KillReport(mode)
    last = 0
    bar: Any = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=kills, desc=f"kill {mode}", leave=False)
    for _ in range(kills):
        reader, writer = ctx.Pipe(duplex=False)
        child = ctx.Process(
            target=_saver_child, args=(mode, str(directory), last + 1, numel, writer)
        )
        with main_module_hidden():
            child.start()
        writer.close()
        if not reader.poll(60) or reader.recv() != -1:
            child.kill()
            raise RuntimeError(f"saver child (pid {child.pid}) never became ready")
        time.sleep(rng.uniform(0.0, max_delay_s))
        child.kill()  # SIGKILL: no handler, no finally, no flush
        child.join()
        with contextlib.suppress(EOFError, OSError):
            while reader.poll():
                last = max(last, reader.recv())
                report.saves_returned += 1
        reader.close()
        report.kills += 1
        _check(mode, directory, last, numel, report)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m refimpl.demos.faults --kills 500 [--modes plain,atomic,checkpoint]``."""
    parser = argparse.ArgumentParser(prog="python -m refimpl.demos.faults", description=__doc__)
    parser.add_argument("--kills", type=int, default=500, help="kills per mode")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=0.15)
    parser.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the reports here")
    args = parser.parse_args(argv)
    import tempfile

    reports = []
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(args.dir or scratch)
        for mode in args.modes.split(","):
            rep = kill_trials(
                mode,
                base / mode,
                args.kills,
                seed=args.seed,
                max_delay_s=args.max_delay,
                progress=True,
            )
            reports.append(rep)
            print(
                f"{mode:>10}: {rep.kills} kills, {rep.saves_returned} saves returned, "
                f"torn {rep.torn}, stale {rep.stale}, skipped {rep.skipped}"
            )
            for ex in rep.examples[:3]:
                print(f"{'':>12}e.g. {ex}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in reports], indent=2) + "\n")
    safe = [r for r in reports if r.mode != "plain"]
    return 0 if all(r.ok for r in safe) else 1


if __name__ == "__main__":
    # Run the imported module's main, so children pickle refimpl.demos.faults._saver_child by its
    # real name rather than as __main__._saver_child.
    from refimpl.demos.faults import main as _main

    sys.exit(_main())
