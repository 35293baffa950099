"""Crafted sharded steps for tests: items changed in ``.metadata`` and the shard files, the
manifest re-forged so that every digest matches (what an attacker, or a foreign tool, can do)."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from refimpl.atomic import COMMIT_MARKER
from refimpl.checkpoint import MANIFEST
from refimpl.sharded._commit import digest_files, write_manifest


def _rewrite(step_dir: Path, metadata: Metadata) -> None:
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    manifest = json.loads((step_dir / MANIFEST).read_bytes())
    names = sorted(p.name for p in step_dir.iterdir() if p.name not in (MANIFEST, COMMIT_MARKER))
    write_manifest(
        step_dir, manifest["step"], digest_files(step_dir, names), manifest["world_size"]
    )


def bytes_item_in_place_of(step_dir: Path, key: str, value: Any) -> None:
    """Make ``key`` (a tensor of the step) a non-tensor item holding ``value``, appended to
    ``__0_0.distcp`` (weights-only loadable: only its kind is wrong)."""
    metadata = pickle.loads((step_dir / ".metadata").read_bytes())
    assert key in metadata.state_dict_metadata, sorted(metadata.state_dict_metadata)
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    buf = io.BytesIO()
    torch.save(value, buf)
    shard = step_dir / "__0_0.distcp"
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(buf.getvalue())
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(
        "__0_0.distcp", offset, len(buf.getvalue())
    )
    _rewrite(step_dir, metadata)


def drop_item(step_dir: Path, key: str) -> None:
    """Remove ``key`` from the step's ``.metadata`` (its bytes stay, unreferenced)."""
    metadata = pickle.loads((step_dir / ".metadata").read_bytes())
    del metadata.state_dict_metadata[key]
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    _rewrite(step_dir, metadata)
