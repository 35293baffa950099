"""Chapter 8's two ways plain DCP goes wrong, each run against `refimpl.sharded` too.

- `torn_overwrite_demo`: ``dcp.save`` twice into one directory, the second failing on rank 1;
  plain ``dcp.load`` then returns half old, half new rows without a word. The same with
  `refimpl.sharded`: nothing is published and the old step loads intact.
- `crafted_metadata_demo`: a ``.metadata`` (and a shard item) whose pickle runs a payload
  (it creates a marker directory) and then returns the real value: plain ``dcp.load`` runs
  it and loads normally; `refimpl.sharded.load_sharded` refuses it and falls back.
- `overwrite_warning`: the ``UserWarning`` a second ``dcp.save`` into one directory raises.
- `metadata_window_demo`: an in-place ``dcp.save`` that stops between removing the old
  ``.metadata`` and renaming the new one into place leaves a directory nothing can load.
- `ctrl_c_demo`: a Ctrl-C during a save, as plain ``dcp.save`` and `save_sharded` raise it.

Like `refimpl.demos.sharded`, each ``*_demo(workdir)`` returns printable, deterministic
results with paths replaced by ``CKPT``.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from refimpl.demos.sharded import LIMITS, failing_writes, max_abs_diff, shard, tiny_model
from refimpl.launch import spawn
from refimpl.sharded import load_sharded, save_sharded
from refimpl.sharded._commit import METADATA, digest_files, write_manifest

__all__ = [
    "crafted_metadata_demo",
    "ctrl_c_demo",
    "metadata_window_demo",
    "overwrite_warning",
    "torn_overwrite_demo",
    "torn_worker",
]


def _set(model: nn.Module, values: list[torch.Tensor], delta: float) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(), values, strict=True):
            p.copy_(v + delta)


def torn_worker(workdir: str) -> tuple[str, str]:
    """Spawned at 2 ranks: save values A, then values B = A + 1 with rank 1's write failing,
    once in place with plain DCP (``workdir/plain``) and once with `save_sharded`
    (``workdir/ckpt``, steps 1 and 2). Returns what each second save raised."""
    model = shard(tiny_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    values_a = [p.detach().clone() for p in model.parameters()]
    outcomes = []
    for plain in (True, False):
        for second in (False, True):
            _set(model, values_a, 1.0 if second else 0.0)
            msd, osd = get_state_dict(model, opt)
            with failing_writes(1) if second else contextlib.nullcontext():
                try:
                    if plain:
                        dcp_save({"model": msd, "optim": osd}, checkpoint_id=f"{workdir}/plain")
                    else:
                        save_sharded(f"{workdir}/ckpt", model, opt, 2 if second else 1)
                except BaseException as exc:  # CheckpointException is a BaseException
                    ranks = sorted(getattr(exc, "failures", {}))
                    outcomes.append(
                        f"{type(exc).__name__} on every rank, naming rank(s) {ranks}; caught "
                        f"by `except Exception`: {isinstance(exc, Exception)}"
                    )
    return outcomes[0], outcomes[1]


def _row_sources(loaded: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> str:
    """Which rows of ``loaded`` equal save A's, which save B's: ``"A rows 10-19, B rows 0-9"``."""
    spans = []
    for name, ref in (("A", a), ("B", b)):
        rows = [i for i in range(loaded.shape[0]) if torch.equal(loaded[i], ref[i])]
        if rows:
            spans.append(f"{name} rows {rows[0]}-{rows[-1]}")
    return ", ".join(spans) or "neither"


def torn_overwrite_demo(workdir: str | os.PathLike[str]) -> list[str]:
    """Overwrite a DCP directory in place with a save that fails on rank 1, then load it."""
    root = Path(workdir)
    plain_err, ours_err = spawn(torn_worker, 2, str(root), **LIMITS)[0]
    a = tiny_model(0).state_dict()
    b = {k: v + 1.0 for k, v in a.items()}
    target = tiny_model(5)
    state = {"model": target.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, checkpoint_id=root / "plain")
    lines = [
        f"plain dcp.save, second save into the same directory: {plain_err}",
        "plain dcp.load of that directory: no error, and it returns",
    ]
    lines += [f"  {k}: {_row_sources(v, a[k], b[k])}" for k, v in state["model"].items()]
    model = tiny_model(5)
    step = load_sharded(root / "ckpt", model, torch.optim.Adam(model.parameters()))
    diff = max_abs_diff(model.state_dict(), dict(a))
    lines += [
        f"refimpl save_sharded, second save: {ours_err}",
        f"refimpl load_sharded: step {step}, max |diff| vs save A: {diff:g}",
    ]
    return lines


class _Mkdir:
    """Unpickles as ``os.mkdir(path)``: a harmless payload that leaves visible evidence."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


class _RunsThenReturns:
    """Unpickles as ``(os.mkdir(marker), value)[1]``: runs the payload, then gives back the
    real ``value``, so whoever loaded it notices nothing."""

    def __init__(self, marker: str, value: Any) -> None:
        self.marker, self.value = marker, value

    def __reduce__(self) -> tuple[Any, ...]:
        return (operator.getitem, ((_Mkdir(self.marker), self.value), 1))


def _forge_manifest(step_dir: Path, step: int) -> None:
    """What an attacker who can write the directory does: re-digest every file."""
    names = [p.name for p in step_dir.iterdir() if p.name in (METADATA,) or p.suffix == ".distcp"]
    write_manifest(step_dir, step, digest_files(step_dir, names), 1)


def _plain_load(step_dir: Path, marker: Path) -> str:
    model = tiny_model(5)
    msd, osd = get_state_dict(model, torch.optim.Adam(model.parameters()))
    state = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, checkpoint_id=step_dir)
    same = max_abs_diff(dict(msd), dict(tiny_model(0).state_dict())) == 0.0
    return f"returned normally, model loaded correctly: {same}; payload ran: {marker.exists()}"


def _collect(into: list[str]) -> Callable[[Path, str], None]:
    return lambda step_dir, why: into.append(f"{step_dir.name}: {why}")


def crafted_metadata_demo(workdir: str | os.PathLike[str]) -> dict[str, str]:
    """A hostile step 2 (its pickles run a payload, and the manifest is re-forged to match)
    beside a good step 1, in one process: what plain ``dcp.load`` and `load_sharded` do.

    Two hiding places: ``.metadata`` (unpickled by DCP with plain ``pickle.load``) and a
    non-tensor item of a shard file (the optimizer's ``lr``: DCP's default planner
    unpickles those with ``torch.load(weights_only=False)``).
    """
    root = Path(workdir)
    out: dict[str, str] = {}
    for where in (".metadata", "shard item"):
        ckpt = root / where.replace(" ", "_").lstrip(".")
        marker = root / f"PAYLOAD_RAN_{where.replace(' ', '_').lstrip('.')}"
        model = tiny_model(0)
        opt = torch.optim.Adam(model.parameters())
        save_sharded(ckpt, model, opt, 1)
        step2 = save_sharded(ckpt, model, opt, 2)
        if where == ".metadata":
            real = pickle.loads((step2 / METADATA).read_bytes())  # we wrote it: trusted here
            (step2 / METADATA).write_bytes(pickle.dumps(_RunsThenReturns(str(marker), real)))
        else:
            msd, osd = get_state_dict(model, opt)
            groups: Any = osd["param_groups"]
            groups[0]["lr"] = _RunsThenReturns(str(marker), 1e-3)
            for f in step2.glob("*.distcp"):
                f.unlink()
            with warnings.catch_warnings():  # "torch.distributed is disabled", "overwriting"
                warnings.simplefilter("ignore")
                dcp_save({"model": msd, "optim": osd}, checkpoint_id=step2, no_dist=True)
        _forge_manifest(step2, 2)
        out[f"plain dcp.load, crafted {where}"] = _plain_load(step2, marker)
        shutil.rmtree(marker)
        skipped: list[str] = []
        target = tiny_model(5)
        step = load_sharded(
            ckpt, target, torch.optim.Adam(target.parameters()), on_skip=_collect(skipped)
        )
        reasons = "; ".join(skipped).replace(str(ckpt), "CKPT")
        out[f"load_sharded, crafted {where}"] = (
            f"loaded step {step}; payload ran: {marker.exists()}; skipped {reasons}"
        )
    return out


def _save_alone(state: dict[str, Any], writer_or_dir: Any) -> None:
    """``dcp.save`` in one process, without DCP's "assuming a single process" notice."""
    kwargs = (
        {"storage_writer": writer_or_dir}
        if isinstance(writer_or_dir, FileSystemWriter)
        else {"checkpoint_id": writer_or_dir}
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save(state, no_dist=True, **kwargs)


def overwrite_warning(workdir: str | os.PathLike[str]) -> str:
    """``dcp.save`` twice into one directory (``FileSystemWriter``'s default ``overwrite=True``)
    in one process; returns the warning the second save raises, its path shown as ``CKPT``
    (torch 2.13 ``filesystem.py:652-659``: a ``warnings.warn``, category ``UserWarning``)."""
    path = Path(workdir) / "latest"
    state = {"model": tiny_model(0).state_dict()}
    _save_alone(state, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save(state, checkpoint_id=path, no_dist=True)
    found = [w for w in caught if "existing checkpoint" in str(w.message)]
    if len(found) != 1:
        raise AssertionError(
            f"expected one overwrite warning, got {[str(w.message) for w in caught]}"
        )
    return f"{found[0].category.__name__}: {str(found[0].message).replace(str(path), 'CKPT')}"


class _StopBeforeRename(Exception):
    """Stands for the process dying right after ``rm_file(.metadata)``."""


def metadata_window_demo(workdir: str | os.PathLike[str]) -> list[str]:
    """Save A into ``latest``, then save B = A + 1 over it in place, stopping where
    ``FileSystemWriter.finish`` has removed the old ``.metadata`` and not yet renamed the new
    one (torch 2.13 ``filesystem.py:787-790``); then list the directory and load it."""
    path = Path(workdir) / "latest"
    model = tiny_model(0)
    _save_alone({"model": model.state_dict()}, path)
    writer = FileSystemWriter(path)

    def stop(_src: Any, _dst: Any) -> None:
        raise _StopBeforeRename("stopped between rm_file and rename")

    writer.fs.rename = stop  # type: ignore[method-assign,assignment]
    try:
        with warnings.catch_warnings():  # the overwrite warning: `overwrite_warning` shows it
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            _save_alone({"model": {k: v + 1.0 for k, v in model.state_dict().items()}}, writer)
    except BaseException as exc:  # CheckpointException wrapping _StopBeforeRename
        stopped = type(exc).__name__
    else:
        raise AssertionError("the second save was not stopped")
    lines = [f"second save stopped ({stopped}); the directory holds {sorted(os.listdir(path))}"]
    logging.disable(logging.WARNING)  # DCP logs each missing .metadata with its traceback
    try:
        target = {"model": tiny_model(5).state_dict()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(target, checkpoint_id=path)
        lines.append("plain dcp.load: loaded")
    except BaseException as exc:
        found = "metadata is None" in str(getattr(exc, "failures", ""))
        lines.append(
            f"plain dcp.load: {type(exc).__name__} (no .metadata found: {found}); "
            "neither save A nor save B can be loaded"
        )
    finally:
        logging.disable(logging.NOTSET)
    return lines


def ctrl_c_demo(workdir: str | os.PathLike[str]) -> list[str]:
    """A ``KeyboardInterrupt`` raised where DCP writes the data, in one process: what plain
    ``dcp.save`` raises (its wrappers catch ``BaseException``: torch 2.13 ``utils.py:194,
    242, 282, 308``) and what `save_sharded` raises."""
    root = Path(workdir)
    model = tiny_model(0)
    opt = torch.optim.Adam(model.parameters())

    def interrupted(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        raise KeyboardInterrupt

    lines = []
    own = FileSystemWriter.__dict__.get("write_data")  # None: inherited (torch 2.13)
    FileSystemWriter.write_data = interrupted  # type: ignore[method-assign,assignment]
    try:
        for name, save in (
            ("plain dcp.save", lambda: _save_alone({"model": model.state_dict()}, root / "p")),
            ("save_sharded", lambda: save_sharded(root / "ckpt", model, opt, 1)),
        ):
            try:
                save()
            except BaseException as exc:
                inner = [type(e).__name__ for e, _t in getattr(exc, "failures", {}).values()]
                carries = f", carrying {', '.join(inner)}" if inner else ""
                lines.append(
                    f"{name}: {type(exc).__name__}{carries}; "
                    f"caught by `except Exception`: {isinstance(exc, Exception)}"
                )
    finally:
        if own is None:
            del FileSystemWriter.write_data  # back to the inherited method
        else:
            FileSystemWriter.write_data = own  # type: ignore[method-assign]
    return lines
