"""The checks `refimpl.checkpoint` runs before it writes anything and before it reads anything.

Before a save: every value must be something ``torch.load(weights_only=True)`` will rebuild,
or the checkpoint could be written, counted and never loaded. Before a load: the manifest is
untrusted input (a crash, a bit flip or a hostile hand may have shaped it), so it is parsed
defensively: bounded size, plain file names only, sizes that are real integers, and a file set
that matches the directory exactly.
"""

from __future__ import annotations

import collections
import json
import math
import operator
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from refimpl._pack import PACK, KeyRange

FORMAT = 3
"""The manifest format this version writes; it reads formats 1, 2 and 3. Formats 1 and 2: one
``KEY.pt`` per top-level key. Format 3: every key in one file, `refimpl._pack.PACK`, at the
range its ``"keys"`` table gives."""
READABLE_FORMATS = (1, 2, 3)
DIGEST_NAMES = ("xxh3_128", "sha256")  # what we write now; what format 1 wrote
MAX_MANIFEST_BYTES = 1 << 20  # a real manifest is a few KB; anything larger is not ours
KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_HEX_RE = re.compile(r"[0-9a-f]{8,128}")
# Exactly these types (not subclasses: np.float64 *is* a float, and is refused) load back.
_PLAIN = (int, float, bool, complex, str, bytes, bytearray, type(None))
# frozenset is missing on purpose: torch 2.13's weights-only unpickler rebuilds set but not
# frozenset (checked by tests/test_checkpoint.py against torch.load itself).
_CONTAINERS = (dict, collections.OrderedDict, list, tuple, set)
_TORCH_VALUES = (torch.Size, torch.dtype, torch.device)


LOADABLE_SUFFIXES = (".pt", ".pack", ".distcp", ".metadata")
"""Names a loader reads (``torch.save`` files, DCP shards and metadata): an unlisted one in a
step is refused; any other stray file (``.DS_Store``, an editor's swap file) is ignored."""


class ManifestError(ValueError):
    """The manifest is malformed; the message says how."""


def loadable_name(name: str) -> bool:
    """Whether a file called ``name`` in a step directory is one a loader would read."""
    return name.endswith(LOADABLE_SUFFIXES)


def find_unloadable(value: Any, where: str = "state", depth: int = 0) -> str | None:
    """Where in ``value`` the first thing ``torch.load(weights_only=True)`` refuses is, or None.

    Returns e.g. ``"state['meta']['path'] is a PosixPath"``. Types registered with
    ``torch.serialization.add_safe_globals`` (or inside a ``safe_globals`` block) count as
    loadable, as they will at load time in the same process.
    """
    if depth > 100:
        return f"{where} is nested more than 100 levels deep"
    kind = type(value)
    if isinstance(value, torch.Tensor):
        return _tensor_problem(value, where, depth)
    if kind in _PLAIN or kind in _TORCH_VALUES:
        return None
    if kind in _CONTAINERS or kind is collections.Counter:
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for key, item in items:
            if isinstance(value, Mapping):
                bad = find_unloadable(key, f"{where} key {key!r}", depth + 1)
                if bad:
                    return bad
            bad = find_unloadable(item, f"{where}[{key!r}]", depth + 1)
            if bad:
                return bad
        return None
    if _allowlisted(kind):
        return None
    return f"{where} is a {kind.__module__}.{kind.__qualname__}"


def as_step(step: Any) -> int:
    """``step`` as a plain int: numpy and 0-d integer tensors are accepted, floats are not;
    ``ValueError`` for anything else or a negative step."""
    if isinstance(step, bool):
        raise ValueError(f"step must be an integer, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError as exc:
        raise ValueError(f"step must be an integer, got {type(step).__name__} {step!r}") from exc
    if value < 0:
        raise ValueError(f"step must be >= 0, got {value}")
    return value


def refusal(state: Mapping[str, Any]) -> str | None:
    """Why ``state`` cannot be saved as a file checkpoint, or None: ``ValueError`` for bad
    keys (not non-empty, file-name-safe strings); else the first value that
    ``torch.load(weights_only=True)`` would not rebuild, and the fix, as one sentence."""
    bad = [k for k in state if not (isinstance(k, str) and KEY_RE.fullmatch(k))]
    if bad or not state:
        raise ValueError(f"state must be a non-empty dict with file-name-safe str keys; bad: {bad}")
    for key, value in state.items():
        problem = find_unloadable(value, f"state[{key!r}]")
        if problem:
            return (
                f"{problem}, which torch.load(weights_only=True) will not rebuild, so this "
                f"checkpoint could never be loaded. Fix: {fix_for(problem)}."
            )
    return None


def _allowlisted(kind: type) -> bool:
    allowed = [g[0] if isinstance(g, tuple) else g for g in torch.serialization.get_safe_globals()]
    return any(kind is a for a in allowed)


def _tensor_problem(value: torch.Tensor, where: str, depth: int) -> str | None:
    """A tensor is pickled as its class plus its Python attributes (torch 2.13,
    ``Tensor.__reduce_ex__``: ``_rebuild_from_type_v2(func, type(self), args, state)``;
    ``Parameter.__reduce_ex__``: ``_rebuild_parameter_with_state``). The weights-only
    unpickler rebuilds only ``Tensor``, ``Parameter`` and allowlisted classes, and the
    attributes must be loadable too, so any ``isinstance(v, Tensor)`` is not enough."""
    kind = type(value)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter and not _allowlisted(kind):
        return f"{where} is a tensor subclass {kind.__module__}.{kind.__qualname__}"
    state = torch._utils._get_obj_state(value)  # type: ignore[no-untyped-call]  # its attributes
    return find_unloadable(state, f"{where}'s attributes", depth + 1) if state else None


def fix_for(kind_text: str) -> str:
    """A concrete suggestion for converting a refused value."""
    if "numpy" in kind_text:
        return "convert numpy values with .item() / float() / int(), arrays with torch.from_numpy"
    if "Path" in kind_text:
        return "store paths as str(path)"
    if "tensor subclass" in kind_text:
        return (
            "store it as a plain tensor (value.as_subclass(torch.Tensor)), or allowlist the "
            "class with torch.serialization.add_safe_globals([...]) in every process that "
            "saves and loads"
        )
    return (
        "convert it to tensors, numbers, strings and containers, or allowlist the type with "
        "torch.serialization.add_safe_globals([...]) in every process that saves and loads"
    )


def parse(path: Path, raw: bytes, present: set[str]) -> dict[str, tuple[int, str, str]]:
    """The manifest's ``{file: (bytes, algorithm, digest)}``, or `ManifestError` saying why not.

    ``present`` is the set of data files in the step directory (everything but the manifest
    and the commit marker): the manifest must list every one of them that a loader would read
    (`loadable_name`), so a file that a forged or damaged manifest leaves out cannot silently
    drop a key from the loaded state; other stray files (``.DS_Store``, ``x.swp``) are ignored.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{len(raw)} bytes, larger than any manifest refimpl writes")
    try:
        manifest = json.loads(raw, parse_constant=_no_constants)
    except RecursionError as exc:
        raise ManifestError("nested too deeply to be a manifest") from exc
    except ValueError as exc:
        raise ManifestError(f"not JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise ManifestError(f"top level is a {type(manifest).__name__}, not an object")
    fmt = manifest.get("format")
    if fmt not in READABLE_FORMATS:
        raise ManifestError(
            f"format {fmt!r}; this refimpl reads formats {READABLE_FORMATS}. It was written by "
            "another (newer?) refimpl: load it with that version"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ManifestError("'files' is missing or not a non-empty object")
    expected: dict[str, tuple[int, str, str]] = {}
    for name, entry in files.items():
        packed = fmt == 3 and name == PACK
        if not packed and not (
            isinstance(name, str) and name.endswith(".pt") and KEY_RE.fullmatch(name[:-3])
        ):
            raise ManifestError(f"file name {name!r} is not a plain KEY.pt name in the step")
        if not isinstance(entry, dict):
            raise ManifestError(f"entry for {name} is not an object")
        size = entry.get("bytes")
        algorithms = [a for a in DIGEST_NAMES if a in entry]
        if type(size) is not int or size < 0:
            raise ManifestError(f"size of {name} is {size!r}, not a byte count")
        if len(algorithms) != 1:
            raise ManifestError(f"entry for {name} needs exactly one of {DIGEST_NAMES}")
        digest = entry[algorithms[0]]
        if not (isinstance(digest, str) and _HEX_RE.fullmatch(digest)):
            raise ManifestError(f"digest of {name} is {digest!r}, not a hex string")
        expected[name] = (size, algorithms[0], digest)
    key_ranges(manifest, expected)  # format 3: its table of keys must tile the files exactly
    # (files it lists but that are missing: named by the caller)
    extra = sorted(n for n in present - set(expected) if loadable_name(n))
    if extra:
        raise ManifestError(
            f"does not list {extra}, found in the step: the state would load incomplete "
            "(a file written there by hand? move it out of the step directory)"
        )
    return expected


def key_ranges(
    manifest: Mapping[str, Any], files: Mapping[str, tuple[int, str, str]]
) -> dict[str, KeyRange]:
    """Where each top-level key is, from a manifest whose ``files`` parsed as ``files``.

    Formats 1 and 2: ``KEY.pt`` holds ``KEY``. Format 3: the ``"keys"`` table, each entry
    ``{"file", "offset", "bytes"}``; the ranges must cover each listed file exactly, without
    gaps or overlaps, or `ManifestError` (a forged table cannot point a key at another's bytes).
    """
    if manifest.get("format") != 3:
        return {name[: -len(".pt")]: KeyRange(name) for name in files}
    table = manifest.get("keys")
    if not isinstance(table, dict) or not table:
        raise ManifestError("format 3 needs a non-empty 'keys' object")
    ranges: dict[str, KeyRange] = {}
    for key, entry in table.items():
        if not (isinstance(key, str) and KEY_RE.fullmatch(key)) or not isinstance(entry, dict):
            raise ManifestError(f"key {key!r} or its entry is malformed")
        file, offset, length = entry.get("file"), entry.get("offset"), entry.get("bytes")
        if not (isinstance(file, str) and file in files):
            raise ManifestError(f"key {key!r}: its file {file!r} is not listed in 'files'")
        if not (type(offset) is int and type(length) is int):
            raise ManifestError(f"key {key!r}: offset {offset!r} or bytes {length!r} is not an int")
        ranges[key] = KeyRange(file, offset, length)
    for name, (size, _, _) in files.items():
        spans = sorted((r.offset, r.length or 0) for r in ranges.values() if r.file == name)
        end = 0
        for offset, length in spans:
            if offset != end or length <= 0:
                raise ManifestError(f"the keys' ranges in {name} have a gap or an overlap")
            end = offset + length
        if end != size:
            raise ManifestError(f"the keys' ranges cover {end} of the {size} bytes of {name}")
    return ranges


def _no_constants(name: str) -> Any:
    raise ManifestError(f"contains {name}, which no manifest refimpl writes holds")


def is_finite_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)
