"""The public API, pinned: the library's modules, each one's ``__all__``, and its commands.

A trainer imports these names and a reader types these commands, so a change to any of them
must be deliberate: a new public module or name goes into the literals below in the same
commit, a removed one breaks user code and needs a reason. Moving a module into a package
(its ``__init__`` re-exporting the old names) keeps every test here green unchanged.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import refimpl

ROOT = Path(__file__).resolve().parent.parent

# The library: every public (no leading underscore) module or package of refimpl, and the
# sorted __all__ of each. Generated once from the code, then read name by name.
PUBLIC_API: dict[str, list[str]] = {
    "atomic": [
        "COMMIT_MARKER",
        "DIGESTS",
        "TEMP_TAG",
        "atomic_dir",
        "atomic_save",
        "atomic_write",
        "atomic_write_bytes",
        "fsync_dir",
        "remove_stale_temps",
        "temp_path",
    ],
    "buckets": [
        "DEFAULT_FIRST_BUCKET_MB",
        "MB",
        "assign_buckets",
        "bucket_bytes",
        "draw_buckets",
        "draw_timeline",
    ],
    "chaos": ["ChaosError", "ChaosRow", "SCENARIOS", "format_table", "main", "run_chaos"],
    "checkpoint": [
        "AsyncCheckpointer",
        "CheckpointError",
        "MANIFEST",
        "PACK",
        "list_checkpoints",
        "load_checkpoint",
        "load_latest",
        "safe_load",
        "save_checkpoint",
        "step_dir_name",
        "verify_checkpoint",
    ],
    "collectives": [
        "global_rank",
        "main",
        "plot_ring_steps",
        "raise_on_rank",
        "rank_info",
        "rank_table",
        "ring_all_reduce",
        "ring_matches_builtin",
        "ring_snapshots",
        "sampler_shards",
        "show_collectives",
        "time_all_reduce",
    ],
    "data": ["RandomOffsets", "ResumableBatches", "ResumableSampler", "sample_seed"],
    "ddp": ["CommHook", "MiniDDP", "NaiveDDP", "broadcast_state", "fp16_compress_hook"],
    "device": ["backend_uses_cuda", "rank_device"],
    "dirlock": ["DirLock", "DirLocked", "Holder", "LOCK_FILE", "check_writable"],
    "guard": [
        "CARRY_BYTES",
        "CollectiveGuard",
        "CollectiveMismatch",
        "FINGERPRINT_LEN",
        "GuardedCall",
        "MAX_DIMS",
        "NAME_BYTES",
        "ReferenceGuard",
    ],
    "launch": [
        "DEFAULT_PG_TIMEOUT_S",
        "DEFAULT_TIMEOUT_S",
        "NotSpawnableError",
        "RankInfo",
        "WorkerError",
        "WorkerTimeout",
        "init_from_env",
        "spawn",
    ],
    "metrics": ["MAX_COUNT", "MAX_KEYS", "MAX_KEY_BYTES", "MetricTotal", "sync_metrics"],
    "mixture": ["MixtureSampler"],
    "sharded": [
        "AsyncSaveHandle",
        "AsyncSaver",
        "PerRank",
        "ShardedCheckpointError",
        "async_save_sharded",
        "consolidate",
        "export_hf",
        "inspect_sharded",
        "load_sharded",
        "save_sharded",
        "verify_sharded",
    ],
    "preemption": ["StopOnSigterm"],
    "state": [
        "ACCUMULATION_KEYS",
        "STATE_KEYS",
        "capture_grads",
        "capture_rng",
        "capture_state",
        "export_safetensors",
        "restore_grads",
        "restore_rng",
        "restore_state",
        "unwrap_model",
        "unwrap_state_dict",
    ],
    "sync": ["MainProcessFailed", "barrier_safe", "main_process_first"],
    "torchft_checkpoint": [
        "MANAGER_KEY",
        "StepManager",
        "batch_for_step",
        "load_ft_checkpoint",
        "save_ft_checkpoint",
    ],
    "train": ["FAULT_MARKER", "main", "make_data", "make_model", "parse_args"],
    "trainstate": [
        "CheckpointMismatch",
        "Resumed",
        "capture_every_rank",
        "check_same_checkpoint",
        "manifest_digest",
        "resume_every_rank",
    ],
}

# Public-looking packages that are not the library (README: "not API"): their names may change
# with the chapters, so only their existence and `python -m refimpl.bench` are pinned.
NOT_LIBRARY = {"bench": "the book's benchmarks", "demos": "the chapters' demos and workers"}

# `python -m refimpl.NAME --help`: exit 0, and the help names what the book and README use.
COMMANDS: dict[str, list[str]] = {
    "train": [
        "--steps",
        "--save-every",
        "--keep-last",
        "--seed",
        "--ckpt-dir",
        "--final-weights",
        "--fail-at-step",
        "--sharded",
        "--async-save",
    ],
    "chaos": ["--kill-on", "--save-on", "--compare", "--json"],
    "checkpoint": ["{list,verify,inspect,export-hf}"],
    "bench": ["{allreduce,ddp,guard,paced,reshard,save,torchft}"],
    "collectives": [],
}


def test_the_list_of_public_modules_is_pinned() -> None:
    """A new public module (or a module made private) must be added here on purpose."""
    found = {m.name for m in pkgutil.iter_modules(refimpl.__path__) if not m.name.startswith("_")}
    expected = set(PUBLIC_API) | set(NOT_LIBRARY)
    assert found == expected, (
        f"new public modules: {sorted(found - expected)}; gone: {sorted(expected - found)}"
    )


@pytest.mark.parametrize("module", sorted(PUBLIC_API))
def test_all_is_pinned_and_every_name_resolves(module: str) -> None:
    mod = importlib.import_module(f"refimpl.{module}")
    names = list(getattr(mod, "__all__", None) or [])
    assert names, f"refimpl.{module} has no __all__"
    assert len(names) == len(set(names)), f"refimpl.{module}.__all__ repeats a name"
    assert sorted(names) == PUBLIC_API[module], (
        f"refimpl.{module}.__all__ changed: added {sorted(set(names) - set(PUBLIC_API[module]))}, "
        f"removed {sorted(set(PUBLIC_API[module]) - set(names))}"
    )
    unresolved = [n for n in names if not hasattr(mod, n)]
    assert not unresolved, f"refimpl.{module}.__all__ names what it does not define: {unresolved}"
    star: dict[str, object] = {}
    exec(f"from refimpl.{module} import *", star)  # what `import *` gives a user
    assert set(names) <= set(star)


def _private_submodule(package: str, name: str) -> bool:
    """Whether ``refimpl.PACKAGE.NAME`` is a private module of a package (not a name in it)."""
    folder = ROOT / "src" / "refimpl" / package
    return name.startswith("_") and ((folder / f"{name}.py").is_file() or (folder / name).is_dir())


def _library_names_used(text: str) -> set[tuple[str, str]]:
    """(module, name) for every ``refimpl.MODULE.NAME`` and ``from refimpl.MODULE import NAME``;
    a package's private submodule (``refimpl.sharded._commit``) counts as private, as a flat
    private module (``refimpl._pack``) does."""
    used = {
        (m, n)
        for m, n in re.findall(r"\brefimpl\.(\w+)\.(\w+)", text)
        if not _private_submodule(m, n)
    }
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(code)
    except SyntaxError:  # markdown, or a cell of shell commands
        return used
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("refimpl."):
            parts = node.module.split(".")
            if len(parts) > 2 and _private_submodule(parts[1], parts[2]):
                continue
            used |= {
                (parts[1], a.name) for a in node.names if not _private_submodule(parts[1], a.name)
            }
    return used


def test_the_book_and_its_demos_use_only_pinned_names() -> None:
    """The chapters, the API pages, the demos and the benchmarks import the library's names
    only through ``__all__``: the pin above covers everything the book shows a reader."""
    sources: dict[str, str] = {}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            sources[f"{nb.name} cell {i}"] = "".join(cell["source"])
    for page in sorted((ROOT / "book").rglob("*.md")):
        sources[str(page.relative_to(ROOT))] = page.read_text()
    for folder in ("demos", "bench"):
        for py in sorted((ROOT / "src" / "refimpl" / folder).rglob("*.py")):
            sources[str(py.relative_to(ROOT))] = py.read_text()
    outside = sorted(
        f"{where}: refimpl.{module}.{name}"
        for where, text in sources.items()
        for module, name in _library_names_used(text)
        if module in PUBLIC_API and name not in PUBLIC_API[module]
    )
    assert len(sources) > 100, "found too few sources to check"
    assert not outside, "names used by the book but not in __all__:\n" + "\n".join(outside)


def test_every_command_prints_its_help_and_exits_0() -> None:
    """``python -m refimpl.{train,chaos,checkpoint,bench,collectives} --help``, run side by side."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", f"refimpl.{name}", "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name in COMMANDS
    }
    failures = []
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=150)
            if proc.returncode != 0 or f"usage: python -m refimpl.{name}" not in out:
                failures.append(f"refimpl.{name}: exit {proc.returncode}\n{out[-800:]}{err[-800:]}")
                continue
            missing = [flag for flag in COMMANDS[name] if flag not in out]
            if missing:
                failures.append(f"refimpl.{name} --help does not mention {missing}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # a --help that hangs must not outlive the test
                proc.kill()
                proc.wait()
    assert not failures, "\n".join(failures)
