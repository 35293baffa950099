"""Chapter 8's two ways plain DCP goes wrong, each run against `refimpl.sharded` too.

- `torn_overwrite_demo`: ``dcp.save`` twice into one directory, the second failing on rank 1;
  plain ``dcp.load`` then returns half old, half new rows without a word. The same with
  `refimpl.sharded`: nothing is published and the old step loads intact.
- `crafted_metadata_demo`: a ``.metadata`` (and a shard item) whose pickle runs a payload
  (it creates a marker directory) and then returns the real value: plain ``dcp.load`` runs
  it and loads normally; `refimpl.sharded.load_sharded` refuses it and falls back.

Like `refimpl.demos.sharded`, each ``*_demo(workdir)`` returns printable, deterministic
results with paths replaced by ``CKPT``.
"""

from __future__ import annotations

import contextlib
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
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from refimpl._sharded_commit import METADATA, digest_files, write_manifest
from refimpl.demos.sharded import LIMITS, failing_writes, max_abs_diff, shard, tiny_model
from refimpl.launch import spawn
from refimpl.sharded import load_sharded, save_sharded

__all__ = [
    "crafted_metadata_demo",
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
