"""The disk side of `refimpl.sharded`: digests, the manifest, verification, the step to load.

A sharded step directory is what ``dcp.save`` wrote (``.metadata`` and one or more
``__RANK_N.distcp`` files per rank) plus refimpl's ``MANIFEST.json`` (size and xxh3-128 digest
of every file) and ``COMMITTED`` marker, written by rank 0 after every rank's files are on
disk. Nothing here talks to other ranks: `refimpl.sharded` does the collectives.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from refimpl import __version__
from refimpl._manifest import MAX_MANIFEST_BYTES
from refimpl._regular_file import is_regular, open_regular, read_regular
from refimpl._step_dirs import DIGEST, MANIFEST, STEP_RE, CheckpointError
from refimpl._system import disk
from refimpl.atomic import (
    COMMIT_MARKER,
    DIGESTS,
    atomic_write,
)
from refimpl.sharded._dcp_metadata import SHARD_NAME_RE, UnsafeMetadata, check_metadata
from refimpl.sharded._seen import Seen, after_hashing, before_hashing

FORMAT = "refimpl.sharded/1"
"""The ``format`` of a sharded step's manifest (refimpl.checkpoint's manifests are ints)."""
METADATA = ".metadata"
_HEX_RE = re.compile(r"[0-9a-f]{32}")
_CHUNK = 1 << 20
_READ_BY_DCP = (".distcp", ".metadata")  # the only files a sharded load opens


def own_shards(directory: Path, rank: int) -> list[str]:
    """The data files rank ``rank`` wrote: `FileSystemWriter` names them ``__RANK_N.distcp``."""
    prefix = f"__{rank}_"
    return sorted(
        p.name
        for p in directory.iterdir()
        if p.name.startswith(prefix) and SHARD_NAME_RE.fullmatch(p.name)
    )


def digest_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """fsync each file and return ``{name: {"bytes": size, "xxh3_128": digest}}``.

    DCP's writer already fsyncs its files (``sync_files=True``); the fsync here is cheap and
    makes "durable before the manifest names it" true whatever writer produced them.
    """
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        digest = DIGESTS[DIGEST]()
        with os.fdopen(open_regular(directory / name), "rb") as f:  # no FIFO, device, link
            disk.fsync(f.fileno())
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
            out[name] = {"bytes": os.fstat(f.fileno()).st_size, DIGEST: digest.hexdigest()}
    return out


def write_manifest(
    directory: Path, step: int, files: Mapping[str, Mapping[str, Any]], world_size: int
) -> None:
    """Write ``MANIFEST.json`` and then the ``COMMITTED`` marker (not yet fsynced)."""
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "files": {name: dict(files[name]) for name in sorted(files)},
        "torch": torch.__version__,
        "refimpl": __version__,
    }
    data = json.dumps(manifest, indent=1).encode()
    atomic_write(directory / MANIFEST, lambda f: f.write(data), durable=False)
    (directory / COMMIT_MARKER).touch()


def _parse(raw: bytes) -> dict[str, tuple[int, str]]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError(f"{len(raw)} bytes, larger than any manifest refimpl writes")
    try:
        manifest = json.loads(raw)
    except RecursionError as exc:
        raise ValueError("nested too deeply to be a manifest") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(
            f"format {str(got)[:100]!r}, not {FORMAT!r}: not a sharded step (refimpl.checkpoint's "
            "load_latest reads the single-file kind)"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or METADATA not in files:
        raise ValueError(f"'files' is missing or does not list {METADATA}")
    out: dict[str, tuple[int, str]] = {}
    for name, entry in files.items():
        if not (name == METADATA or SHARD_NAME_RE.fullmatch(name)):
            raise ValueError(f"lists {name[:100]!r}, which is not a DCP file name")
        size = entry.get("bytes") if isinstance(entry, dict) else None
        digest = entry.get(DIGEST) if isinstance(entry, dict) else None
        valid_digest = isinstance(digest, str) and _HEX_RE.fullmatch(digest)
        if type(size) is not int or size < 0 or not valid_digest:
            raise ValueError(f"entry of {name} has no valid size and {DIGEST}")
        out[name] = (size, str(digest))
    return out


def read_manifest(step_dir: Path) -> tuple[dict[str, Any], dict[str, tuple[int, str]]]:
    """The step's manifest and its ``{file: (bytes, digest)}``; `CheckpointError` if unusable.

    Read with `read_regular`: a FIFO or a link to a device named ``MANIFEST.json`` is refused
    at once instead of blocking the loader.
    """
    manifest_path = step_dir / MANIFEST
    try:
        raw = read_regular(manifest_path, MAX_MANIFEST_BYTES)
        expected = _parse(raw)
        manifest: dict[str, Any] = json.loads(raw)
    except OSError as exc:
        raise CheckpointError(manifest_path, f"manifest missing or unreadable ({exc})") from exc
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as exc:  # ValueError, or whatever else a crafted manifest provokes
        raise CheckpointError(manifest_path, f"manifest refused ({exc})") from exc
    return manifest, expected


def _digest_seen(path: Path) -> tuple[str, Seen | None]:
    """``path``'s digest, and the `Seen` record of the descriptor it was read from."""
    with os.fdopen(open_regular(path), "rb") as f:  # no FIFO, device, link
        seen = before_hashing(f.fileno())
        digest = DIGESTS[DIGEST]()
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        return digest.hexdigest(), after_hashing(f.fileno(), seen)


def verify_step(step_dir: Path, seen: dict[str, Seen] | None = None) -> dict[str, Any]:
    """Check a sharded step without unpickling anything DCP-made; return its manifest.

    Marker, manifest (format, plain DCP file names only), every listed file present and no
    unlisted file that a sharded load would read (``*.distcp``, ``*.metadata``: other strays
    such as ``.DS_Store`` or a ``*.pt`` are never opened, so ignored), each file's size and
    xxh3-128 digest, and
    finally ``.metadata`` through the allowlist unpickler (`check_metadata`), which also
    checks that every item points inside a listed shard. Raises `CheckpointError` naming the
    step or file and the first problem; any other error a crafted step provokes becomes one.
    ``seen``, if given, receives the `refimpl.sharded._seen.Seen` record of each data file
    hashed here (for `refimpl.sharded.load_sharded`'s other ranks).
    """
    try:
        return _verify_step(step_dir, {} if seen is None else seen)
    except CheckpointError:
        raise
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as exc:
        raise CheckpointError(
            step_dir, f"cannot be verified ({type(exc).__name__}: {exc})"
        ) from exc


def _verify_step(step_dir: Path, seen: dict[str, Seen]) -> dict[str, Any]:
    if not is_regular(step_dir / COMMIT_MARKER):
        raise CheckpointError(step_dir, f"incomplete: no {COMMIT_MARKER} marker (save unfinished)")
    manifest, expected = read_manifest(step_dir)
    try:
        present = {p.name for p in step_dir.iterdir()} - {MANIFEST, COMMIT_MARKER}
    except OSError as exc:
        raise CheckpointError(step_dir, f"cannot be listed ({exc})") from exc
    missing = sorted(set(expected) - present)
    unlisted = sorted(n for n in present - set(expected) if n.endswith(_READ_BY_DCP))
    if missing or unlisted:
        found = f"found {unlisted}, which the manifest does not list" if unlisted else ""
        gone = f"missing {missing}, which the manifest lists" if missing else ""
        raise CheckpointError(
            step_dir, f"files differ from the manifest: {'; '.join(w for w in (found, gone) if w)}"
        )
    for name, (nbytes, digest) in sorted(expected.items()):
        path = step_dir / name
        try:
            if not is_regular(path):
                raise CheckpointError(path, "not a regular file (listed in the manifest)")
            size = path.stat().st_size
            if size != nbytes:
                raise CheckpointError(path, f"size {size} bytes, manifest says {nbytes}")
            got, record = _digest_seen(path)
            if got != digest:
                raise CheckpointError(path, f"{DIGEST} differs from the manifest (corrupted bytes)")
            if record is not None and name != METADATA:
                seen[name] = record
        except OSError as exc:
            raise CheckpointError(path, f"cannot be read ({exc})") from exc
    sizes = {name: size for name, (size, _d) in expected.items() if name != METADATA}
    try:
        check_metadata(step_dir / METADATA, sizes, expect=expected[METADATA])
    except (UnsafeMetadata, OSError) as exc:
        raise CheckpointError(step_dir / METADATA, f"refused before DCP opened it: {exc}") from exc
    named = STEP_RE.fullmatch(step_dir.name)
    if type(manifest.get("step")) is not int or (named and int(named[1]) != manifest["step"]):
        raise CheckpointError(
            step_dir / MANIFEST, f"says step {manifest.get('step')!r}, not this one"
        )
    return manifest


Expected = dict[str, tuple[int, str]]
"""A verified manifest's ``{file: (bytes, digest)}``."""
