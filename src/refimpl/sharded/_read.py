"""The reading side of `refimpl.sharded`: what DCP is allowed to read, and how.

- `VerifyingReader`: DCP's ``FileSystemReader``, except that every rank verifies the digest of
  each shard file *it* is about to read, from the same open file it then reads from, before
  any tensor is copied; and ``.metadata`` is the object already unpickled through the
  allowlist (from bytes that matched the manifest), never a second plain ``pickle.load``.
- planners that load DCP's non-tensor items weights-only;
- `check_keys`: the checkpoint's model keys must be the model's, as ``load_state_dict(strict=
  True)`` requires (DCP's planner only loads what the target asks for, so a checkpoint with
  an extra layer would load silently).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, ClassVar

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from refimpl._regular_file import open_regular
from refimpl._step_dirs import DIGEST
from refimpl.atomic import DIGESTS
from refimpl.sharded._ranges import read_ranges
from refimpl.sharded._seen import Seen, after_hashing, before_hashing, unchanged

_CHUNK = 1 << 20


class UnsafeItem(ValueError):
    """A non-tensor item of a shard file is a pickle that is not weights-only."""


class ShardMismatch(ValueError):
    """A shard file this rank was about to read differs from the manifest rank 0 verified."""


class _VerifiedFiles(FileSystem):
    """DCP's ``FileSystem`` whose ``create_stream(path, "rb")`` hands out the already verified
    open file of that name, so DCP reads exactly the bytes whose digest was checked."""

    def __init__(self, opened: Mapping[str, IO[bytes]]) -> None:
        self.opened = opened

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        stream = self.opened.get(Path(path).name)
        if mode != "rb" or stream is None:
            raise ShardMismatch(f"DCP asked for {path} ({mode}), which this rank did not verify")
        stream.seek(0)
        yield stream


class VerifyingReader(FileSystemReader):
    """Read ``step_dir`` with DCP, verifying on each rank what that rank reads.

    ``expected`` is the manifest rank 0 verified, ``{file: (bytes, digest)}``, and
    ``metadata`` the ``.metadata`` every rank already unpickled through the allowlist.

    Why each rank checks its own files rather than trusting rank 0's check: ranks on other
    nodes may read another copy (node-local disks, caches, a file replaced after the check).
    Why from the same open file: a hash of the path followed by a later open could read a
    file swapped in between. In `prepare_local_plan` (which DCP runs on every rank before
    the plans are exchanged) this rank opens each file its plan reads, refusing anything but
    a regular file, checks size and digest through that descriptor, and keeps it open;
    ``read_data`` then reads from those descriptors only. A mismatch on any rank therefore
    fails the plan exchange on every rank before a single tensor is copied, and
    `refimpl.sharded.load_sharded` falls back to an older step.

    ``seen`` (`refimpl.sharded._seen`): what rank 0 recorded of each file while hashing it.
    A descriptor that shows, on rank 0's machine, the same inode with the same size and
    times is the file rank 0 hashed, unchanged: it is not hashed again. Any other (another
    machine, another inode, a write since, a file changed just before rank 0 looked) is.
    The cost of the hash is all of a file, even when this rank reads a few of its rows.
    """

    legacy_reads: ClassVar[bool] = False
    """True: read as refimpl did before `refimpl.sharded._ranges` and `seen`: every file
    hashed by every rank that reads it, every item through DCP's own per-item path
    (``python -m refimpl.bench reshard`` measures both ways side by side)."""

    def __init__(
        self,
        step_dir: Path,
        expected: Mapping[str, tuple[int, str]],
        metadata: Metadata,
        seen: Mapping[str, Seen] | None = None,
    ) -> None:
        super().__init__(step_dir)
        self._expected = dict(expected)
        self._seen = dict(seen or {})
        self.hashed: list[str] = []
        """The files this rank hashed itself (the others: unchanged since rank 0 did)."""
        self.records: dict[str, Seen] = {}
        """What this rank saw of each file it hashed (`refimpl.sharded._seen`), so that a
        second load of the same step in this process need not hash it again."""
        self._metadata = metadata
        self._opened: dict[str, IO[bytes]] = {}
        self.fs = _VerifiedFiles(self._opened)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's per-rank fallback: refimpl never writes one
            raise FileNotFoundError("refimpl steps have one global .metadata")
        if getattr(self._metadata, "storage_meta", None) is None:  # as FileSystemReader does
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return self._metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        try:
            for name in names:
                self._opened[name] = self._open_verified(name)
        except BaseException:
            self.close()
            raise
        return plan

    def _open_verified(self, name: str) -> IO[bytes]:
        if name not in self._expected:
            raise ShardMismatch(f"{name} is not listed in the manifest rank 0 verified")
        size, digest = self._expected[name]
        f = os.fdopen(open_regular(Path(self.path) / name), "rb")
        try:
            seen = None if self.legacy_reads else self._seen.get(name)
            if unchanged(f.fileno(), seen) and os.fstat(f.fileno()).st_size == size:
                return f  # the very file rank 0 just hashed on this machine, not changed since
            self.hashed.append(name)
            record = before_hashing(f.fileno())
            hasher = DIGESTS[DIGEST]()
            got = 0
            while chunk := f.read(_CHUNK):
                hasher.update(chunk)
                got += len(chunk)
            if got != size or hasher.hexdigest() != digest:
                raise ShardMismatch(
                    f"{name} has {got} bytes with {DIGEST} {hasher.hexdigest()} on this rank; "
                    f"the manifest rank 0 verified says {size} bytes, {digest}"
                )
            record = after_hashing(f.fileno(), record)
            if record is not None:
                self.records[name] = record
        except BaseException:
            f.close()
            raise
        return f

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan from the verified files, each tensor item's needed bytes only
        (`refimpl.sharded._ranges`); what that cannot place goes through DCP's own path."""
        try:
            if self.legacy_reads:
                return super().read_data(plan, planner)
            left = read_ranges(self._verified, self.storage_data, plan.items, planner)
            if left:
                return super().read_data(dataclasses.replace(plan, items=left), planner)
            done: Future[None] = Future()
            done.set_result(None)
            return done
        finally:
            self.close()

    def _verified(self, name: str) -> IO[bytes]:
        stream = self._opened.get(name)
        if stream is None:
            raise ShardMismatch(f"DCP asked for {name}, which this rank did not verify")
        return stream

    def close(self) -> None:
        """Close the files opened for verification (``read_data`` does it when done)."""
        for f in self._opened.values():
            f.close()
        self._opened.clear()


def check_keys(
    metadata: Metadata, model_state: Mapping[str, Any], excluded: Collection[str] = ()
) -> str | None:
    """Why the checkpoint's ``model`` items do not fit ``model_state``, or None.

    Both sides are compared as DCP flattens them (``model.0.weight``, ...), like
    ``load_state_dict(strict=True)``: keys only in the checkpoint (the model lost a layer)
    and keys only in the model (it gained one). ``excluded`` names of the model (not
    loaded) are left out on both sides.
    """
    flat, _mappings = flatten_state_dict({"model": dict(model_state)})
    mine = set(flat)
    skip = tuple(f"model.{name}" for name in excluded)

    def kept(key: str) -> bool:  # a non-tensor value is flattened into KEY.sub.keys
        return not any(key == s or key.startswith(s + ".") for s in skip)

    mine = {k for k in mine if kept(k)}
    saved = {k for k in metadata.state_dict_metadata if k.startswith("model.") and kept(k)}
    unexpected, missing = sorted(saved - mine), sorted(mine - saved)
    if not unexpected and not missing:
        return None
    parts = []
    if unexpected:
        parts.append(f"unexpected key(s) in the checkpoint {_few(unexpected)}")
    if missing:
        parts.append(f"key(s) of the model missing from the checkpoint {_few(missing)}")
    return "does not match the model: " + "; ".join(parts)


def check_kinds(metadata: Metadata, planned: Mapping[str, Any]) -> str | None:
    """Why an item the load would read is a tensor in the step and not in ``planned`` (the
    state dict DCP loads into), or the other way round, or None.

    A step built by this model's save has each item as the kind the model holds; another kind
    (a non-tensor item where the model has a weight) is a crafted or foreign step, which DCP
    would load, putting the item where the tensor was, and ``set_state_dict`` refuse. The
    optimizer's hyper-parameters (``optim.param_groups``) are left out: a learning rate saved
    as a float loads into an optimizer whose rate is a tensor, and the other way round DCP
    refuses on its own.
    """
    flat, _mappings = flatten_state_dict(dict(planned))
    wrong = []
    for key, value in flat.items():
        saved = metadata.state_dict_metadata.get(key)
        if saved is None or key.startswith("optim.param_groups."):
            continue
        tensor_saved = not isinstance(saved, BytesStorageMetadata)
        if tensor_saved != isinstance(value, torch.Tensor):
            kind = "a tensor" if tensor_saved else "a non-tensor item"
            wrong.append(f"{key!r} is {kind} in the step, a {type(value).__name__} here")
    return f"items of another kind than this run's: {_few(wrong)}" if wrong else None


def _few(keys: list[str], limit: int = 8) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return f"{keys[:limit]}{more}"


def _weights_only(read_item: ReadItem, value: io.BytesIO) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        asks = f"it asks for {found.group(1)}" if found else str(exc).strip()[:200]
        raise UnsafeItem(
            f"refused item {read_item.dest_index.fqn!r}: its pickle is not weights-only and "
            f"could run code ({asks})"
        ) from exc


class _WeightsOnlyBytes:
    """``load_bytes`` with ``weights_only=True``: DCP's default planner unpickles non-tensor
    items (optimizer hyper-parameters, ...) with ``torch.load(weights_only=False)``."""

    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = _weights_only(read_item, value)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class WeightsOnlyLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items load weights-only."""


class WeightsOnlyEmptyPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """The planner ``dcp_to_torch_save`` uses (rebuilds the whole state), weights-only;
    ``keys`` limits it to those top-level keys."""

    def __init__(self, keys: list[str] | None = None) -> None:
        _EmptyStateDictLoadPlanner.__init__(self, keys)  # type: ignore[no-untyped-call]
