"""`refimpl.chaos`'s command line: its options, the table, the report below it, the exit
status."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from refimpl._system.argtypes import int_range
from refimpl.chaos._scenarios import help_text
from refimpl.chaos._verdict import ChaosError, ChaosRow, format_table


def cli(argv: Sequence[str] | None, run: Callable[..., list[ChaosRow]], title: str) -> int:
    """``python -m refimpl.chaos [options] -- CMD...`` with ``run`` (`refimpl.chaos.run_chaos`)
    and the help's ``title``: 0 when every scenario passes, 1 when one fails, 2 when the test
    could not run (`ChaosError`, printed)."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args_in:
        args_in.append("--")
    split = args_in.index("--")
    p = argparse.ArgumentParser(
        prog="python -m refimpl.chaos",
        usage="%(prog)s [options] -- CMD",
        description=title,
        epilog=help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    p.add_argument(
        "--scenarios",
        help="comma-separated, from the list below (default: the first "
        "four, plus resize-job with --resize-to, kill-in-write with --ckpt-dir, rng-perturb "
        "with --perturb)",
    )
    p.add_argument(
        "--perturb",
        action="store_true",
        help="also run rng-perturb: does the result depend on the RNG after --kill-on?",
    )
    p.add_argument(
        "--resize-to",
        type=int_range(1),
        metavar="N",
        help="resize-job reruns the killed job with --nproc-per-node=N",
    )
    p.add_argument(
        "--ckpt-dir",
        metavar="DIR",
        help="kill-in-write watches this directory under {out} for a file open for writing",
    )
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
        rows = run(
            cmd,
            kill_on=args.kill_on,
            compare=args.compare,
            save_on=args.save_on,
            resume_on=args.resume_on,
            scenarios=None
            if args.scenarios is None
            else [s for s in args.scenarios.split(",") if s],
            resize_to=args.resize_to,
            ckpt_dir=args.ckpt_dir,
            perturb=args.perturb,
            timeout_s=args.timeout,
            work=args.work,
            jobs=args.jobs,
            reference=args.reference,
            stall_s=args.stall,
            env=extra,
            ignore=args.ignore,
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
    except ChaosError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if rows and rows[0].compared:
        print(f"compared {args.compare}: {rows[0].compared}")
    for row in rows:
        if not row.equal or row.scenario in ("resize-job", "rng-perturb"):
            print(f"\n{row.scenario}: {row.detail or row.difference}\n  logs: {row.log}")
    what = "bit-identical to the reference"
    if any(r.scenario in ("resize-job", "rng-perturb") for r in rows):
        what = "passed (bit-identical to the reference; resize-job: resumed and finished)"
    print(
        f"{sum(r.equal for r in rows)}/{len(rows)} scenarios {what} "
        f"({time.monotonic() - start:.0f} s)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0 if all(r.equal for r in rows) else 1
