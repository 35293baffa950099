"""The ``state=`` of `refimpl.sharded`: everything besides the model and optimizer, in the step.

``state`` maps names to objects with ``state_dict()`` / ``load_state_dict()`` (DCP's
``Stateful`` protocol: an LR scheduler, `refimpl.data.ResumableSampler`, an RNG holder) or to
plain values (a step counter, user metadata). Each entry is serialised at the call with
``torch.save`` and checked to load back with ``weights_only=True`` (so a value that could run
code on load is refused when it is saved, not when it is needed); the bytes travel as one DCP
*bytes item*, in the same ``dcp.save`` as the model, hence in the same manifest, digests and
commit.

- An entry is **shared** unless wrapped in `PerRank`: saved once (DCP writes a bytes item that
  every rank holds under the same name only once) under ``state.<name>``, restored on every
  rank at any world size. A shared entry must be equal on every rank: the save compares
  digests and refuses one that differs, naming it, instead of keeping one rank's silently.
- A `PerRank` entry (RNG streams, anything rank-local) is saved by each rank under
  ``state_rank<r>.<name>`` and restored on the same rank when the world size is the one that
  saved it. At another world size there is no "same rank": it is *not* restored, the wrapper's
  ``restored`` is False and `refimpl.sharded.load_sharded` logs which entries it left alone,
  so the caller re-seeds (or whatever its object needs) knowingly.
"""

from __future__ import annotations

import copy
import hashlib
import io
import pickle
import re
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

SHARED = "state"
_RANK_KEY = "state_rank{rank}"
RANK_KEY_RE = re.compile(r"state_rank(\d+)")


class PerRank:
    """Marks a ``state=`` entry whose value differs by rank (an RNG stream, a rank's cursor).

    Saved by every rank under its own key and restored on the same rank at the same world
    size. At another world size it is left as it is and ``restored`` is False (the load logs
    it): per-rank values have no meaningful owner when the ranks change.

    Example::

        state = {"sched": scheduler, "rng": PerRank(RngState())}
        save_sharded("ckpt", model, opt, step, state=state)
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.restored: bool | None = None  # set by load_sharded: True, or False when skipped

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r})"


def rank_key(rank: int) -> str:
    """The top-level key under which rank ``rank`` saves its `PerRank` entries."""
    return _RANK_KEY.format(rank=rank)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _unwrap(value: Any) -> Any:
    return value.obj if isinstance(value, PerRank) else value


def _loads(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")


def _dumps(name: str, value: Any) -> bytes:
    obj = _unwrap(value)
    payload = obj.state_dict() if _is_stateful(obj) else obj
    buf = io.BytesIO()
    try:
        torch.save(payload, buf)
        _loads(buf.getvalue())
    except (pickle.PicklingError, pickle.UnpicklingError, TypeError, AttributeError) as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        first = f"it needs {found.group(1)}" if found else f"{type(exc).__name__}: {exc}"[:200]
        raise TypeError(
            f"state[{name!r}] cannot be saved so that it loads weights-only ({first}); keep it "
            "to tensors, numbers, strings, None and lists, tuples and dicts of them"
        ) from exc
    return buf.getvalue()


def pack(state: Mapping[str, Any], rank: int) -> tuple[dict[str, Any], dict[str, str]]:
    """This rank's ``{top-level key: {name: bytes}}`` for ``dcp.save``, and the digest of each
    shared entry (the caller compares them across ranks with `differing`).

    Raises ``TypeError`` naming the entry that is not weights-only loadable."""
    shared: dict[str, bytes] = {}
    mine: dict[str, bytes] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"state names must be non-empty strings, got {name!r}")
        (mine if isinstance(value, PerRank) else shared)[name] = _dumps(name, value)
    out: dict[str, Any] = {}
    if shared:
        out[SHARED] = shared
    if mine:
        out[rank_key(rank)] = mine
    digests = {name: hashlib.sha256(blob).hexdigest() for name, blob in shared.items()}
    return out, digests


def differing(per_rank_digests: list[dict[str, str]]) -> list[str]:
    """Names of shared entries whose bytes are not the same on every rank."""
    first = per_rank_digests[0]
    return sorted(
        name for name in first if any(d.get(name) != first[name] for d in per_rank_digests[1:])
    )


def check_mapping(state: Mapping[str, Any]) -> None:
    """A load fills plain values back into ``state``: it must be a mutable mapping then."""
    plain = [n for n, v in state.items() if not _is_stateful(_unwrap(v))]
    if plain and not isinstance(state, MutableMapping):
        raise TypeError(f"state must be a dict to receive the plain value(s) {plain}")


def targets(
    state: Mapping[str, Any], rank: int, same_world: bool, saved: set[str]
) -> tuple[dict[str, Any], list[str], list[str]]:
    """What DCP should read for ``state`` on this rank: ``({top-level key: {name: b""}},
    missing entries, per-rank entries left alone because the world size changed)``.

    ``saved`` is the set of flattened keys in the step's ``.metadata``."""
    out: dict[str, dict[str, bytes]] = {}
    missing: list[str] = []
    skipped: list[str] = []
    for name, value in state.items():
        per_rank = isinstance(value, PerRank)
        if per_rank and not same_world:
            skipped.append(name)
            continue
        top = rank_key(rank) if per_rank else SHARED
        if f"{top}.{name}" not in saved:
            other = SHARED if per_rank else rank_key(rank)
            how = (
                " (it was saved as the other kind: shared vs PerRank)"
                if (f"{other}.{name}" in saved)
                else ""
            )
            missing.append(f"{name!r}{how}")
            continue
        out.setdefault(top, {})[name] = b""
    return out, missing, skipped


def decode(loaded: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: value}`` from what DCP read back (bytes per name), weights-only."""
    values: dict[str, Any] = {}
    for top, entries in loaded.items():
        for name, blob in entries.items():
            if not isinstance(blob, bytes):
                raise pickle.UnpicklingError(f"{top}.{name} holds {type(blob).__name__}, not bytes")
            values[name] = _loads(blob)
    return values


class Applied:
    """The ``state=`` entries `apply` changed on this rank and what each held before, so that
    a load that fails on any rank can put every entry back (`undo`)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state
        self.before: list[tuple[str, Any, bool | None]] = []  # (name, previous, restored)

    def keep(self, name: str) -> None:
        """Record what entry ``name`` holds now: its state_dict (copied) or its value."""
        entry = self.state[name]
        obj = _unwrap(entry)
        previous = copy.deepcopy(obj.state_dict()) if _is_stateful(obj) else obj
        restored = entry.restored if isinstance(entry, PerRank) else None
        self.before.append((name, previous, restored))

    def undo(self) -> list[str]:
        """Put every recorded entry back, newest first; return those that refused."""
        refused = []
        for name, previous, restored in reversed(self.before):
            entry = self.state[name]
            obj = _unwrap(entry)
            try:
                if _is_stateful(obj):
                    obj.load_state_dict(previous)
                elif isinstance(entry, PerRank):
                    entry.obj = previous
                else:
                    self.state[name] = previous  # type: ignore[index]  # check_mapping did
            except Exception as exc:  # reported: the caller's error says to rebuild it
                refused.append(f"state[{name!r}] ({type(exc).__name__}: {exc})")
            if isinstance(entry, PerRank):
                entry.restored = restored
        self.before.clear()
        return refused


def apply(
    state: Mapping[str, Any], values: Mapping[str, Any], skipped: list[str], applied: Applied
) -> None:
    """Put the loaded ``values`` in place: ``load_state_dict`` for stateful objects, the
    mapping (or the `PerRank` wrapper) for plain values; mark `PerRank` entries. Each entry
    is recorded in ``applied`` before it is changed. Raises ``RuntimeError`` naming the
    entry whose ``load_state_dict`` raised (the entries before it are already set)."""
    for name, value in values.items():
        try:
            applied.keep(name)
        except Exception as exc:
            raise RuntimeError(
                f"state[{name!r}]: its current state could not be copied (to put it back if "
                f"the load fails): {type(exc).__name__}: {exc}"
            ) from exc
        entry = state[name]
        obj = _unwrap(entry)
        if _is_stateful(obj):
            try:
                obj.load_state_dict(value)
            except Exception as exc:
                raise RuntimeError(
                    f"state[{name!r}].load_state_dict raised {type(exc).__name__}: {exc}"
                ) from exc
        elif isinstance(entry, PerRank):
            entry.obj = value
        else:
            state[name] = value  # type: ignore[index]  # check_mapping made sure it can
        if isinstance(entry, PerRank):
            entry.restored = True
    for name in skipped:
        applied.keep(name)
        state[name].restored = False


def names_in(saved_keys: list[str]) -> tuple[list[str], list[str], list[int]]:
    """``(shared names, per-rank names, ranks that saved per-rank entries)`` of a step."""
    shared: set[str] = set()
    per_rank: set[str] = set()
    ranks: set[int] = set()
    for key in saved_keys:
        top, _, name = key.partition(".")
        if top == SHARED:
            shared.add(name)
        elif (m := RANK_KEY_RE.fullmatch(top)) is not None:
            per_rank.add(name)
            ranks.add(int(m[1]))
    return sorted(shared), sorted(per_rank), sorted(ranks)


def pack_checked(group: Any, state: Mapping[str, Any] | None) -> dict[str, Any]:
    """Collective on ``group`` (a `refimpl.sharded._group.Group`): `pack` on every rank, then
    raise on every rank if any rank's entry cannot be saved (``TypeError``) or a shared entry
    differs between ranks (``ValueError``), before anything touches the disk."""
    if not state:
        return {}
    try:
        packed, digests = pack(state, group.rank)
        mine = None
    except TypeError as exc:
        packed, digests, mine = {}, {}, f"rank {group.rank}: {exc}"
    gathered = group.gather((mine, digests))
    errors = [why for why, _d in gathered if why]
    if errors:
        raise TypeError("; ".join(errors))
    differ = differing([d for _w, d in gathered])
    if differ:
        raise ValueError(
            f"state entries {differ} differ between ranks: wrap a per-rank value in "
            "refimpl.sharded.PerRank (each rank saves its own), or make it the same everywhere"
        )
    return packed
