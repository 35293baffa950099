"""Test-only workers for tests/test_guard.py and tests/test_metrics.py (importable by name)."""

from __future__ import annotations

import random
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.guard import CollectiveGuard, CollectiveMismatch, ReferenceGuard
from refimpl.metrics import MAX_KEY_BYTES, sync_metrics


def _call(guard: CollectiveGuard | ReferenceGuard, op: str, name: str, t: torch.Tensor) -> None:
    """One guarded call: ``op`` is a guard method, or ``all_reduce_<op>`` for another reduce op."""
    if op == "all_reduce":
        guard.all_reduce(t, name=name)
    elif op.startswith("all_reduce_"):  # all_reduce_max, all_reduce_band, ...
        guard.all_reduce(t, name=name, op=getattr(dist.ReduceOp, op[11:].upper()))
    elif op == "broadcast":
        guard.broadcast(t, 0, name=name)
    elif op == "all_gather":
        guard.all_gather([torch.empty_like(t) for _ in range(dist.get_world_size())], t, name=name)
    elif op == "barrier":
        guard.barrier(name=name)


def guarded_calls(plan: list[list[tuple[str, str, list[int], str]]]) -> dict[str, Any]:
    """Rank r makes the calls ``plan[r]`` = [(op, name, shape, dtype)] through one guard.
    Returns how many it completed and the mismatch (its calls, as strings) if one was raised."""
    rank = dist.get_rank()
    guard = CollectiveGuard(timeout_s=3.0)
    done = 0
    try:
        for op, name, shape, dtype in plan[rank]:
            _call(guard, op, name, torch.ones(shape, dtype=getattr(torch, dtype)))
            done += 1
    except CollectiveMismatch as exc:
        return {
            "done": done,
            "error": str(exc),
            "calls": [str(c) if c else None for c in exc.calls],
        }
    return {"done": done, "error": None, "calls": []}


def verdicts_of_each_guard(
    cases: list[list[list[tuple[str, str, list[int], str]]]],
) -> list[dict[str, str | None]]:
    """For each case (rank r makes ``case[r]``), each guard's verdict: None when every call
    passed, else the `CollectiveMismatch` message and its calls. The fast guard on each of its
    exchange paths and the reference guard see the same calls, in the same order."""
    guards = {
        "fast": CollectiveGuard(timeout_s=10.0),
        "fast_gloo": CollectiveGuard(timeout_s=10.0, host_exchange=False),
        "reference": ReferenceGuard(timeout_s=10.0),
    }
    out = []
    for case in cases:
        verdicts: dict[str, str | None] = {}
        for which, guard in guards.items():
            try:
                for op, name, shape, dtype in case[dist.get_rank()]:
                    _call(guard, op, name, torch.ones(shape, dtype=getattr(torch, dtype)))
                verdicts[which] = None
            except CollectiveMismatch as exc:
                verdicts[which] = f"{exc}\n{[str(c) for c in exc.calls]}"
        out.append(verdicts)
    return out


def guard_switched_off_pairs_silently() -> float:
    """With the guard off, ranks reducing differently named metrics get a (wrong) sum."""
    guard = CollectiveGuard(enabled=False)
    t = torch.tensor([float(dist.get_rank() + 1)])
    guard.all_reduce(t, name=f"metric_of_rank_{dist.get_rank()}")
    return t.item()


def sync_these(per_rank: list[dict[str, tuple[float, int]]]) -> dict[str, tuple[float, int]]:
    out = sync_metrics(per_rank[dist.get_rank()])
    return {k: (v.sum, v.count) for k, v in out.items()}


_KEYS = st.text(alphabet="abcdefghij/_", min_size=1, max_size=12)
_VALUE = st.tuples(st.integers(-1000, 1000).map(lambda v: v / 8), st.integers(0, 50))


def sync_metrics_property(world: int, examples: int) -> int:
    """Hypothesis runs the same examples in the same order on every rank (derandomized);
    each example gives every rank its own random key set, possibly empty. Checks every rank
    gets exactly the expected union and totals, and that ranks stayed in lockstep."""
    rank = dist.get_rank()
    seen = [0]

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None)
    @given(st.lists(st.dictionaries(_KEYS, _VALUE, max_size=6), min_size=world, max_size=world))
    def check(per_rank: list[dict[str, tuple[float, int]]]) -> None:
        # every rank must be looking at the same example, or the test itself is broken
        digest = torch.tensor([zlib.crc32(repr(per_rank).encode())], dtype=torch.int64)
        low, high = digest.clone(), digest.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        assert low.item() == high.item(), "ranks drew different examples"
        got = sync_metrics(per_rank[rank])
        expected: dict[str, list[float]] = {}
        for local in per_rank:
            for k, (s, c) in local.items():
                acc = expected.setdefault(k, [0.0, 0])
                acc[0] += s
                acc[1] += c
        assert list(got) == sorted(expected)
        for k, (s, c) in expected.items():
            assert got[k].sum == s and got[k].count == c, (k, got[k], s, c)
        seen[0] += 1

    check()
    return seen[0]


def too_long_name_on(bad_rank: int) -> str:
    local = {"ok": (1.0, 1)}
    if dist.get_rank() == bad_rank:
        local["x" * (MAX_KEY_BYTES + 1)] = (1.0, 1)
    try:
        sync_metrics(local)
    except ValueError as exc:
        return str(exc)
    return "no error"


def random_keys(seed: int) -> dict[str, tuple[float, int]]:
    rng = random.Random(seed * 10 + dist.get_rank())
    local = {
        f"k{rng.randrange(20)}": (float(rng.randrange(100)), rng.randrange(1, 5))
        for _ in range(rng.randrange(0, 6))
    }
    got = sync_metrics(local)
    return {k: (v.sum, v.count) for k, v in got.items()}


def sync_on_all_but_last() -> str:
    if dist.get_rank() == dist.get_world_size() - 1:
        dist.barrier()  # the last rank is somewhere else entirely
        return "left"
    sync_metrics({"a": (1.0, 1)})
    return "synced"


def sync_each_case(cases: list[list[dict[str, Any]]]) -> list[str]:
    """For each case, rank r syncs ``case[r]``; the error text (or the totals) per case. The
    ranks stay in lockstep across cases only if an error is raised on every rank alike."""
    out = []
    for case in cases:
        try:
            got = sync_metrics(case[dist.get_rank()])
            out.append(repr({k: (v.sum, v.count) for k, v in got.items()}))
        except (ValueError, TypeError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def guard_default_timeout() -> tuple[float, float]:
    """A guard built without ``timeout_s``: its timeout, and its check group's actual one."""
    guard = CollectiveGuard()
    backend = guard._check_group._get_backend(torch.device("cpu"))
    return guard.timeout_s, backend.options._timeout.total_seconds()


def rank0_arrives_late(late_s: float) -> str:
    """Rank 0 reaches a guarded call ``late_s`` after rank 1, whose guard gives up after 1 s
    and leaves: what each rank's error says."""
    guard = CollectiveGuard(timeout_s=1.0)
    if dist.get_rank() == 0:
        time.sleep(late_s)  # a rank-0-only task (a save, an evaluation)
    try:
        guard.all_reduce(torch.ones(1), name="after/save")
    except CollectiveMismatch as exc:
        return str(exc)
    return "no error"


def store_keys_after_agreeing_calls(n: int) -> list[str]:
    """``n`` guarded calls that agree; then the guard's keys found in the store (none)."""
    guard = CollectiveGuard(timeout_s=5.0)
    for i in range(n):
        guard.all_reduce(torch.ones(2), name=f"metric/{i}")
    guard.barrier(name="done")
    store = dist.distributed_c10d._get_default_store()
    keys = [f"{guard._key}/{r}" for r in range(dist.get_world_size())]
    return [k for k in keys if store.check([k])]


def carried_against_plain(ops: list[str], dtypes: list[str]) -> list[tuple[str, str, bool, str]]:
    """For every (op, dtype): the guarded all-reduce of a small tensor (carried in the
    exchange) and the plain ``dist.all_reduce`` of the same values. Returns (op, dtype,
    equal, guarded result's bytes as hex) so the caller can compare ranks too."""
    import hashlib

    rank = dist.get_rank()
    guard = CollectiveGuard(timeout_s=5.0)
    out = []
    for op_name in ops:
        op = getattr(dist.ReduceOp, op_name)
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            gen = torch.Generator().manual_seed(1000 + rank)
            values = torch.randn(3, 5, generator=gen) * 3 + (1.5 if op_name == "PRODUCT" else 0)
            values = values.to(dtype)
            guarded, plain = values.clone(), values.clone()
            guard.all_reduce(guarded, name=f"{op_name}/{dtype_name}", op=op)
            dist.all_reduce(plain, op=op)
            digest = hashlib.sha256(guarded.view(torch.uint8).numpy().tobytes()).hexdigest()
            out.append((op_name, dtype_name, torch.equal(guarded, plain), digest))
    return out


def _collectives_so_far() -> dict[str, int]:
    """The collectives this rank's flight recorder holds, by group (WORLD or other) and op."""
    import pickle

    raw = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    counts: dict[str, int] = {}
    world_name = dist.group.WORLD.group_name
    for entry in raw["entries"]:
        group = "world" if entry["process_group"][0] == world_name else "other"
        key = f"{group} {entry['profiling_name']}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def collectives_per_guarded_call(host_exchange: bool) -> dict[str, dict[str, int]]:
    """Three guarded all-reduces of a metric (16 B), one of 1 MiB: the collectives each group
    ran while the guard was built, and during the calls."""
    guard = CollectiveGuard(timeout_s=5.0, host_exchange=host_exchange)
    built = _collectives_so_far()
    for i in range(3):
        guard.all_reduce(torch.ones(2, dtype=torch.float64), name=f"metric/{i}")
    big = torch.ones(2**17, dtype=torch.float64)
    guard.all_reduce(big, name="big")
    assert big[0].item() == dist.get_world_size()
    after = _collectives_so_far()
    calls = {k: n - built.get(k, 0) for k, n in after.items() if n != built.get(k, 0)}
    return {"built": built, "calls": calls}


def carried_odd_tensors() -> list[bool]:
    """Non-contiguous views and a tensor that requires grad, guarded: each against the sum
    every rank can compute (plain ``dist.all_reduce`` of a view with gaps is wrong on gloo:
    it reduces the first numel elements of the storage)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    guard = CollectiveGuard(timeout_s=5.0)
    total = sum(r + 1 for r in range(world))

    def base(factor: float) -> torch.Tensor:
        return torch.arange(12, dtype=torch.float32).reshape(3, 4) * factor

    out = []
    for make in (lambda b: b.t(), lambda b: b[:, 1], lambda b: b[::2]):
        guarded = make(base(rank + 1))
        assert not guarded.is_contiguous()
        guard.all_reduce(guarded, name="odd")
        out.append(torch.equal(guarded, make(base(total))))
    with_grad = torch.ones(3, requires_grad=True) * (rank + 1)  # non-leaf, requires grad
    guard.all_reduce(with_grad, name="grad")
    out.append(with_grad.tolist() == [float(total)] * 3)
    return out
