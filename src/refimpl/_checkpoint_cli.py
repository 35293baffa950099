"""``python -m refimpl.checkpoint {list,verify,inspect,export-hf} PATH``: checkpoints from a shell.

- ``list DIR``: every step, its size, and whether it is complete and verifies;
- ``verify DIR|STEP_DIR``: exit status 0 only if everything checked verifies (a directory of
  steps: every committed step), else 1, naming the bad file and the reason;
- ``inspect STEP_DIR``: keys, tensor shapes and dtypes, and the versions that wrote it; for a
  sharded step also the world size that saved it, its size and its ``state=`` names
  (`refimpl.sharded.inspect_sharded`);
- ``export-hf STEP_DIR OUT_DIR [--dtype bf16] [--max-shard-size 2GB]``: a sharded step's model
  as Hugging Face safetensors (`refimpl.sharded.export_hf`).

Each step is checked as the kind its manifest says it is: a file checkpoint
(`refimpl.checkpoint`, integer format) or a sharded one (`refimpl.sharded`, format
``"refimpl.sharded/1"``). Nothing is unpickled before it verifies, and then only with
``weights_only=True`` (a sharded step's ``.metadata``: through the allowlist unpickler).

What cannot be used gets a line of its own and exit status 1: an entry named like a step that
is a symbolic link loop, a link to nowhere or not a directory (``list``, ``verify``); a path
that is such a link or that this user may not read. A step that is a symbolic link is checked
and marked as one.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from refimpl._manifest import MAX_MANIFEST_BYTES
from refimpl._regular_file import read_regular
from refimpl.atomic import COMMIT_MARKER
from refimpl.checkpoint import (
    MANIFEST,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    verify_checkpoint,
)
from refimpl.sharded import export_hf, inspect_sharded, verify_sharded

SHARDED_FORMAT = "refimpl.sharded/1"  # refimpl.sharded._commit.FORMAT, without importing DCP


def _size(path: Path) -> str:
    """Bytes of the regular files under ``path``, readable; ``?`` if part of it cannot be read.
    Links are not followed (a link to a large file elsewhere, or to a directory outside the
    step, counts nothing)."""
    total = 0
    errors: list[OSError] = []
    for top, _dirs, files in os.walk(path, onerror=errors.append):  # links to dirs: not entered
        for name in files:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError as exc:
                errors.append(exc)
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return "?" if errors else _human(total)


def _is_sharded(step_dir: Path) -> bool:
    """Whether the step's manifest says it is a sharded (DCP) step; False if unreadable (the
    file-checkpoint verifier then names the problem)."""
    try:
        manifest = json.loads(read_regular(step_dir / MANIFEST, MAX_MANIFEST_BYTES))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == SHARDED_FORMAT


def _verifier(step_dir: Path) -> Callable[[Path], dict[str, Any]]:
    if _is_sharded(step_dir):
        return verify_sharded
    return verify_checkpoint


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _unusable(path: Path) -> str | None:
    """Why ``path`` (given on the command line) cannot be read at all, or None: a symbolic
    link loop or to nowhere, or not permitted; said in one line instead of a traceback or a
    misleading "no step_N directories" (a plain missing path: None, each command says so)."""
    try:
        os.stat(path)  # follows a symbolic link
        if path.is_dir():
            os.listdir(path)
    except OSError as exc:
        if _is_link_error(exc, path):
            return _link_problem(exc, path)
        if isinstance(exc, FileNotFoundError):
            return None  # each command says what it missed
        return f"cannot be read ({exc.strerror or exc})"
    return None


def _is_link_error(exc: OSError, path: Path) -> bool:
    """Whether ``exc`` came from following the symbolic link ``path`` (a loop, or nowhere)."""
    return exc.errno in (errno.ELOOP, errno.ENOENT) and path.is_symlink()


def _link_problem(exc: OSError, path: Path) -> str:
    if exc.errno == errno.ELOOP:
        return "a symbolic link loop (it resolves back to itself)"
    return f"a symbolic link to {os.readlink(path)}, which does not exist"


def _step_named(name: str) -> bool:
    """Whether ``name`` has the form of a step directory's (``step_`` and 8 or more digits)."""
    digits = name.removeprefix("step_")
    return digits != name and len(digits) >= 8 and digits.isascii() and digits.isdigit()


def _unlisted(root: Path, listed: list[tuple[int, Path]]) -> list[tuple[Path, str]]:
    """Entries of ``root`` named like a step that the listing of steps skipped, and why: a
    symbolic link loop or to nowhere, or something not a directory."""
    seen = {d.name for _, d in listed}
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name in seen or not _step_named(entry.name):
            continue
        try:
            os.stat(entry)
            why = "not a directory: not a step"
        except OSError as exc:
            why = _link_problem(exc, entry) if _is_link_error(exc, entry) else exc.strerror or ""
            why += ": not a step; remove it"
        found.append((entry, why))
    return found


def _linked(step_dir: Path) -> str:
    """`` (a symbolic link to TARGET)`` for a linked step directory, else nothing."""
    return f" (a symbolic link to {os.readlink(step_dir)})" if step_dir.is_symlink() else ""


def _steps_or_one(path: Path) -> list[tuple[int | None, Path]]:
    if (path / MANIFEST).exists() or (path / COMMIT_MARKER).exists():
        return [(None, path)]
    return [(step, d) for step, d in list_checkpoints(path)]


def _cmd_list(path: Path) -> int:
    steps = list_checkpoints(path)
    unlisted = _unlisted(path, steps) if path.is_dir() else []
    if not steps and not unlisted:
        print(f"{path}: no step_N directories")
        return 1
    bad = 0
    for step, step_dir in steps:
        try:
            _verifier(step_dir)(step_dir)
            status = "verified"
        except CheckpointError as exc:
            status, bad = f"BAD: {exc.reason}", bad + 1
        print(f"{step:>10}  {_size(step_dir):>10}  {status}{_linked(step_dir)}")
    for entry, why in unlisted:
        print(f"{entry.name:>10}  {'?':>10}  BAD: {why}")
    return 1 if bad or unlisted else 0


def _cmd_verify(path: Path) -> int:
    targets = _steps_or_one(path)
    listed = [(step, d) for step, d in targets if step is not None]
    unlisted = _unlisted(path, listed) if len(listed) == len(targets) and path.is_dir() else []
    if not targets and not unlisted:
        print(f"{path}: nothing to verify (no step_N directories, not a step directory)")
        return 1
    failed = len(unlisted)
    for _, step_dir in targets:
        try:
            manifest = _verifier(step_dir)(step_dir)
            count = len(manifest["files"])
            plural = "" if count == 1 else "s"
            print(f"OK   {step_dir}: {count} file{plural} verified{_linked(step_dir)}")
        except CheckpointError as exc:
            failed += 1
            print(f"BAD  {exc.path}: {exc.reason}")
    for entry, why in unlisted:
        print(f"BAD  {entry}: {why}")
    return 1 if failed else 0


def _describe(value: Any, prefix: str, lines: list[str], limit: int = 40) -> None:
    if len(lines) >= limit:
        return
    if isinstance(value, torch.Tensor):
        lines.append(f"{prefix}: tensor {tuple(value.shape)} {str(value.dtype).split('.')[-1]}")
    elif isinstance(value, dict):
        if not value:
            lines.append(f"{prefix}: {{}}")
        for key, item in value.items():
            _describe(item, f"{prefix}.{key}", lines, limit)
    elif isinstance(value, (list, tuple)) and len(value) > 8:
        lines.append(f"{prefix}: {type(value).__name__} of {len(value)}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _describe(item, f"{prefix}[{i}]", lines, limit)
    else:
        lines.append(f"{prefix}: {type(value).__name__} {value!r:.60}")


def _sharded_report(step_dir: Path) -> list[str]:
    """What `refimpl.sharded.inspect_sharded` finds, as lines: header, state names, keys."""
    info = inspect_sharded(step_dir)
    lines = [
        f"{step_dir}: step {info['step']}, format {info['format']}, saved by "
        f"{info['world_size']} rank(s), {_human(info['bytes'])} in {info['files']} files, "
        f"torch {info['torch'] or '?'}, refimpl {info['refimpl'] or '?'}",
        f"  state: {', '.join(info['state']) or '-'}; per rank: "
        f"{', '.join(info['per_rank_state']) or '-'}",
    ]
    for fqn, item in info["keys"].items():
        if "shape" in item:
            chunks = f", {item['chunks']} shards" if item["chunks"] > 1 else ""
            lines.append(f"  {fqn}: tensor {tuple(item['shape'])} {item['dtype']}{chunks}")
        else:
            lines.append(f"  {fqn}: object (read weights-only on load)")
    return lines


def _cmd_inspect(path: Path) -> int:
    try:
        if _is_sharded(path):
            lines = _sharded_report(path)
        else:
            manifest = verify_checkpoint(path)
            lines = [
                f"{path}: step {manifest.get('step')}, format {manifest.get('format')}, "
                f"torch {manifest.get('torch', '?')}, refimpl {manifest.get('refimpl', '?')}"
            ]
            for key, value in load_checkpoint(path).items():
                described: list[str] = []
                _describe(value, key, described)
                lines += [f"  {line}" for line in described]
    except CheckpointError as exc:
        print(f"BAD  {exc.path}: {exc.reason}")
        return 1
    print("\n".join(lines))
    return 0


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "keep": None}


def _cmd_export_hf(step_dir: Path, out_dir: Path, dtype: str, max_size: str | None) -> int:
    try:
        files = export_hf(step_dir, out_dir, dtype=_DTYPES[dtype], max_shard_bytes=max_size)
    except CheckpointError as exc:
        print(f"BAD  {exc.path}: {exc.reason}")
        return 1
    except ValueError as exc:  # an out_dir that holds checkpoints, a size that is not one
        print(f"REFUSED  {exc}")
        return 1
    for file in files:
        print(f"{file}  {_human(file.stat().st_size)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m refimpl.checkpoint``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m refimpl.checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("list", "steps, sizes, verified or not"),
        ("verify", "exit 0 only if everything verifies"),
        ("inspect", "keys, shapes, dtypes, versions of one step"),
    ):
        sub.add_parser(name, help=text).add_argument("path", type=Path)
    export = sub.add_parser("export-hf", help="a sharded step's model as HF safetensors")
    export.add_argument("path", type=Path, help="a sharded step_N directory")
    export.add_argument("out_dir", type=Path, help="the export directory (replaced atomically)")
    export.add_argument("--dtype", choices=list(_DTYPES), default="bf16", help="keep: as saved")
    export.add_argument("--max-shard-size", help="split into files of at most e.g. 2GB, 500MiB")
    args = parser.parse_args(argv)
    if args.command == "export-hf":
        return _cmd_export_hf(args.path, args.out_dir, args.dtype, args.max_shard_size)
    command = {"list": _cmd_list, "verify": _cmd_verify, "inspect": _cmd_inspect}
    why = _unusable(args.path)
    if why is not None:
        print(f"{args.path}: {why}")
        return 1
    try:
        return command[args.command](args.path)
    except OSError as exc:  # e.g. a directory inside that this user may not read
        print(f"{exc.filename or args.path}: cannot be read ({exc.strerror or exc})")
        return 1
