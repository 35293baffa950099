"""refimpl.sharded._paced_writer: a background DCP write handed to the kernel in 1 MiB pieces, with
sleeps that keep the writing thread's CPU time under its share of the wall time; files that
plain ``dcp.load`` reads; a synchronous save left unpaced."""

from __future__ import annotations

import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from refimpl import _pacer
from refimpl.sharded import _paced_writer
from refimpl.sharded._paced_writer import (
    MAX_SLEEP_S,
    MIN_CPU_SHARE,
    PIECE_BYTES,
    PacedWriter,
    _Pacer,
    stop_pacing,
)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    # 3.5 MiB and a small one: pieces of 1 MiB, and a last piece shorter than the rest
    return {"big": torch.randn(7 * PIECE_BYTES // 8, generator=gen), "small": torch.arange(5.0)}


class _Recorder:
    """Replaces the pacer's clocks and sleep: what the writing thread did, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, Any]] = []
        real_wait = _Pacer.wait
        recorder = self

        def wait(pacer: _Pacer) -> None:
            recorder.events.append(("wait", threading.get_ident()))
            real_wait(pacer)

        monkeypatch.setattr(_Pacer, "wait", wait)
        real_write = _paced_writer._PacedStream.write

        def write(stream: Any, data: Any) -> int:
            n = real_write(stream, data)
            recorder.events.append(("write", n))
            return n

        monkeypatch.setattr(_paced_writer._PacedStream, "write", write)
        real_raw = _paced_writer._PacedStream.__init__

        def init(stream: Any, raw: Any, pacer: _Pacer) -> None:
            real_raw(stream, _SpyFile(raw, recorder.events), pacer)

        monkeypatch.setattr(_paced_writer._PacedStream, "__init__", init)


class _SpyFile:
    def __init__(self, raw: Any, events: list[tuple[str, Any]]) -> None:
        self._raw, self._events = raw, events

    def write(self, data: Any) -> int:
        self._events.append(("piece", memoryview(data).nbytes))
        return int(self._raw.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every sleep the pacer asks for, recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(_pacer._UNPACED, "wait", slept.append)
    return slept


def _async_save(state: dict[str, torch.Tensor], writer: PacedWriter) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        future = dcp.async_save(
            {"model": state},
            storage_writer=writer,
            no_dist=True,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )
        future.result(timeout=60)


def _assert_reads_back(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Plain ``dcp.load`` reads ``state`` back from ``path``, bit for bit."""
    out = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, checkpoint_id=path, no_dist=True)
    assert all(torch.equal(out["model"][k], state[k]) for k in state)


def _pieces(rec: _Recorder) -> list[int]:
    """The sizes of the pieces the paced stream handed the kernel, checked: the big records
    were cut up, into pieces of at most PIECE_BYTES."""
    pieces = [n for kind, n in rec.events if kind == "piece"]
    assert pieces and max(pieces) == PIECE_BYTES, pieces
    return pieces


@pytest.mark.timeout(60)
def test_a_background_write_goes_in_paced_pieces_and_plain_dcp_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = _Recorder(monkeypatch)
    state = _state()
    _async_save(state, PacedWriter(tmp_path / "ck", cpu_share=0.5))
    pieces = _pieces(rec)
    assert sum(n for kind, n in rec.events if kind == "write") == sum(pieces)
    # every piece handed to the kernel is followed by a wait, in the writing thread
    kinds = [kind for kind, _ in rec.events if kind != "write"]
    assert kinds == ["piece", "wait"] * len(pieces), kinds
    assert {t for kind, t in rec.events if kind == "wait"} != {threading.get_ident()}
    _assert_reads_back(tmp_path / "ck", state)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("share", [None, 1.0])
def test_unpaced_background_writes_never_sleep_and_only_share_1_cuts_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, share: float | None
) -> None:
    rec = _Recorder(monkeypatch)
    slept = _sleeps(monkeypatch)
    state = _state()
    _async_save(state, PacedWriter(tmp_path / "bg", cpu_share=share))
    assert slept == []
    if share is None:  # DCP's own writes: a record per call, no paced stream at all
        assert rec.events == []
    else:
        _pieces(rec)
    _assert_reads_back(tmp_path / "bg", state)


@pytest.mark.timeout(60)
def test_a_synchronous_save_writes_as_dcp_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = _Recorder(monkeypatch)
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"model": state},
            storage_writer=PacedWriter(tmp_path / "fg", cpu_share=0.01),
            no_dist=True,
        )
    assert rec.events == []  # no paced stream was ever made: the caller's own thread
    _assert_reads_back(tmp_path / "fg", state)


def test_the_pacer_sleeps_until_cpu_time_is_within_its_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = {"cpu": 10.0, "wall": 100.0}
    monkeypatch.setattr(_pacer.time, "thread_time", lambda: clock["cpu"])
    monkeypatch.setattr(_pacer.time, "monotonic", lambda: clock["wall"])
    slept = _sleeps(monkeypatch)
    pacer = _Pacer(0.25)
    pacer.start()
    clock["cpu"] += 0.5  # half a CPU-second in 1 s of wall: at 25%, due at 2 s
    clock["wall"] += 1.0
    pacer.wait()
    assert slept == [pytest.approx(1.0)]
    clock["wall"] += 3.0  # idle long enough: no sleep
    pacer.wait()
    assert slept == [pytest.approx(1.0)]


def test_one_sleep_is_capped_and_stop_pacing_ends_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A writer whose CPU clock is far ahead (a burst of serialising, a share of 1e-7 before
    shares that small were refused) sleeps at most MAX_SLEEP_S per piece, not 10**4 s; once
    the process exits (stop_pacing), it sleeps no more."""
    clock = {"cpu": 10.0, "wall": 100.0}
    monkeypatch.setattr(_pacer.time, "thread_time", lambda: clock["cpu"])
    monkeypatch.setattr(_pacer.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(_pacer, "_UNPACED", threading.Event())  # this test's own
    slept = _sleeps(monkeypatch)
    pacer = _Pacer(MIN_CPU_SHARE)
    pacer.start()
    clock["cpu"] += 100.0  # due in 10**4 s at 1% of a core
    pacer.wait()
    assert slept == [MAX_SLEEP_S]
    stop_pacing()
    pacer.wait()
    assert slept == [MAX_SLEEP_S]


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, "0.5", float("nan"), 1e-7, MIN_CPU_SHARE / 2, True])
def test_a_share_outside_its_floor_to_one_is_refused(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"cpu_share must be a number in \[0\.01, 1\]"):
        PacedWriter(tmp_path, cpu_share=bad)


def test_the_writer_pickles_for_dcps_checkpoint_process(tmp_path: Path) -> None:
    writer = pickle.loads(pickle.dumps(PacedWriter(tmp_path, cpu_share=0.2, nice=5)))
    assert (writer.cpu_share, writer.nice) == (0.2, 5)
