"""`inspect_sharded`: what a sharded step holds, read without a process group or a model.

A trainer deciding how to resume (is the per-rank RNG restorable at this world size? which
``state=`` names are there?) should not parse ``MANIFEST.json`` by hand. This verifies the
step (marker, manifest, every digest, ``.metadata`` through the allowlist unpickler) and
describes it from the manifest and ``.metadata`` alone: no shard file is unpickled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from refimpl.sharded._commit import METADATA, verify_step
from refimpl.sharded._dcp_metadata import check_metadata
from refimpl.sharded._state import names_in


def inspect_sharded(step_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Verify one sharded step and describe it; no process group needed.

    Returns a dict with ``step``, ``world_size`` (the ranks that saved it), ``format``,
    ``torch`` and ``refimpl`` (the versions that wrote it), ``bytes`` (all its files),
    ``files`` (how many), ``keys`` (each flattened DCP key: ``{"shape": [...], "dtype":
    "float32", "chunks": n}`` for a tensor, ``{"object": True}`` for a non-tensor item),
    ``state`` (the shared ``state=`` names) and ``per_rank_state`` (the `PerRank` names).
    Raises `refimpl.checkpoint.CheckpointError` naming the first problem, as
    `refimpl.sharded.verify_sharded` does.

    Example::

        info = inspect_sharded("ckpt/step_00000200")
        same_size = info["world_size"] == world   # can its per-rank RNG be restored here?
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step_dir = Path(step_dir)
    manifest = verify_step(step_dir)
    files = manifest["files"]
    sizes = {name: e["bytes"] for name, e in files.items() if name != METADATA}
    meta = files[METADATA]
    expect = (meta["bytes"], meta["xxh3_128"])  # the bytes just verified, nothing swapped in
    metadata = check_metadata(step_dir / METADATA, sizes, expect=expect)
    keys: dict[str, dict[str, Any]] = {}
    for fqn, item in sorted(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            keys[fqn] = {
                "shape": list(item.size),
                "dtype": str(item.properties.dtype).removeprefix("torch."),
                "chunks": len(item.chunks),
            }
        else:
            keys[fqn] = {"object": True}
    shared, per_rank, _ranks = names_in(list(keys))
    return {
        "step": manifest["step"],
        "world_size": manifest.get("world_size"),
        "format": manifest["format"],
        "torch": manifest.get("torch"),
        "refimpl": manifest.get("refimpl"),
        "bytes": sum(e["bytes"] for e in files.values()),
        "files": len(files),
        "keys": keys,
        "state": shared,
        "per_rank_state": per_rank,
    }
