"""Chapters 8-9's workers and demonstrations: DCP's failure modes, and what refimpl does.

Each ``*_demo(workdir)`` builds its own checkpoints under ``workdir`` and returns printable
lines (paths replaced by ``CKPT``), deterministic for a given torch: seeded models, results
from rank 0 or in rank order.

- `resharding_demo`: save an FSDP2 model + Adam at 4 ranks, load at 2 and at 3; compare with
  the unsharded state the 4 ranks had.
- `torn_overwrite_demo`: ``dcp.save`` twice into one directory, the second failing on rank 1;
  plain ``dcp.load`` then returns half old, half new rows without a word. The same with
  `refimpl.sharded`: nothing is published and the old step loads intact.
- `crafted_metadata_demo`: a ``.metadata`` (and a shard item) whose pickle runs a payload
  (it creates a marker directory) and then returns the real value: plain ``dcp.load`` runs
  it and loads normally; `refimpl.sharded.load_sharded` refuses it and falls back.
"""

from __future__ import annotations

import contextlib
import operator
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from refimpl._sharded_commit import METADATA, digest_files, write_manifest
from refimpl.atomic import atomic_save
from refimpl.checkpoint import safe_load
from refimpl.launch import spawn
from refimpl.sharded import load_sharded, save_sharded

_TIMEOUT_S = 120.0
_PG_TIMEOUT_S = 20.0


def tiny_model(seed: int = 0) -> nn.Sequential:
    """A 12-20-6 MLP: 20 rows split 5/5/5/5 at 4 ranks, 10/10 at 2, 7/7/6 at 3."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 6))


def shard(model: nn.Sequential) -> nn.Sequential:
    """FSDP2 (``fully_shard``) per layer and at the root, on a CPU mesh of all ranks."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """A few Adam steps; each rank draws its own seeded batch of 8."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 6, generator=gen)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole (unsharded) model and optimizer state, on rank 0 (empty on the others)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    return {"model": msd, "optim": osd}


def max_abs_diff(a: Any, b: Any, where: str = "state") -> float:
    """Largest absolute difference between two nested states; a structural mismatch raises."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            raise ValueError(f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            raise ValueError(f"{where}: keys differ: {sorted(set(a) ^ set(b), key=str)}")
        return max((max_abs_diff(a[k], b[k], f"{where}[{k!r}]") for k in a), default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return max((max_abs_diff(x, y, f"{where}[{i}]") for i, (x, y) in pairs), default=0.0)
    if a != b:
        raise ValueError(f"{where}: {a!r} vs {b!r}")
    return 0.0


def _rows(model: nn.Sequential) -> int:
    """How many rows of the first weight this rank holds."""
    weight: Any = model[0].weight
    return int(weight.to_local().shape[0])


def save_worker(ckpt_dir: str, ref_path: str, steps: int) -> int:
    """Spawned: train an FSDP2 model ``steps`` steps, `save_sharded` the last, and write the
    unsharded reference to ``ref_path`` (rank 0). Returns this rank's rows of ``0.weight``."""
    model = shard(tiny_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(1, steps + 1))
    save_sharded(ckpt_dir, model, opt, steps)
    full = full_state(model, opt)
    if dist.get_rank() == 0:
        atomic_save(full, ref_path)
    return _rows(model)


def load_worker(ckpt_dir: str, ref_path: str) -> tuple[int | None, int, float, float]:
    """Spawned at any world size: `load_sharded` into a differently initialised FSDP2 model;
    returns ``(step, this rank's rows, max |diff| model, max |diff| optimizer)`` (diffs on
    rank 0, against the unsharded reference; 0.0 elsewhere)."""
    model = shard(tiny_model(99))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = load_sharded(ckpt_dir, model, opt)
    full = full_state(model, opt)
    rows = _rows(model)
    if dist.get_rank() != 0:
        return step, rows, 0.0, 0.0
    ref = safe_load(ref_path)
    model_diff = max_abs_diff(full["model"], ref["model"], "model")
    return step, rows, model_diff, max_abs_diff(full["optim"], ref["optim"], "optim")


def resharding_demo(
    workdir: str | os.PathLike[str], save_world: int = 4, load_worlds: tuple[int, ...] = (2, 3)
) -> list[str]:
    """Save at ``save_world`` ranks, load at each of ``load_worlds``; lines to print."""
    root = Path(workdir)
    ckpt, ref = str(root / "ckpt"), str(root / "unsharded.pt")
    limits: dict[str, Any] = {"timeout_s": _TIMEOUT_S, "pg_timeout_s": _PG_TIMEOUT_S}
    rows = spawn(save_worker, save_world, ckpt, ref, 3, **limits)
    lines = [f"saved step 3 at {save_world} ranks; rows of 0.weight per rank: {rows}"]
    for world in load_worlds:
        out = spawn(load_worker, world, ckpt, ref, **limits)
        step, _r, dm, do = out[0]
        lines.append(
            f"loaded at {world} ranks: step {step}, rows per rank {[r[1] for r in out]}, "
            f"max |diff| vs unsharded: model {dm:g}, optimizer {do:g}"
        )
    return lines


@contextlib.contextmanager
def failing_writes(rank: int, how: str = "raise") -> Iterator[None]:
    """On rank ``rank`` only, make DCP's `FileSystemWriter` fail as it starts writing data:
    ``"raise"`` an ENOSPC, or ``"exit"``: write half a shard and ``os._exit(1)`` (a kill)."""
    if (dist.get_rank() if dist.is_initialized() else 0) != rank:
        yield
        return

    def write_data(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        shard_file = Path(self.path) / f"__{rank}_0.distcp"
        if how == "exit":
            shard_file.write_bytes(b"\0" * 64)  # half a shard, then gone: no except, no finally
            os._exit(1)
        raise OSError(28, "No space left on device (simulated)", str(shard_file))

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del FileSystemWriter.write_data  # back to the inherited method


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
    limits: dict[str, Any] = {"timeout_s": _TIMEOUT_S, "pg_timeout_s": _PG_TIMEOUT_S}
    plain_err, ours_err = spawn(torn_worker, 2, str(root), **limits)[0]
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
