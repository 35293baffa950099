"""refimpl on one CUDA GPU under NCCL: the checks CI cannot run (it has no GPU).

Usage, on a machine with a GPU and torch (from the repository root):

    PYTHONPATH=src python tools/gpu_check.py --out gpu-out/

It writes ``gpu_check.json`` (and prints each result as it goes):

1. ``copy``: device-to-host copy bandwidth into pageable and into pinned (page-locked) host
   memory, beside a host-to-host memcpy of the same bytes: the floor of an async save's
   staging on this GPU (chapter 9 quotes it, naming the GPU).
2. ``train``: ``torchrun --nproc-per-node=1 -m refimpl.train`` under NCCL for the file, sharded
   and sharded async backends: a run killed at a step and restarted by torchrun must end with
   the same final weights, bit for bit, as the uninterrupted run (chapter 10's claim, on a GPU).
3. ``save``: one rank saving a model of about 1 GiB on the GPU: `save_sharded`'s time and
   `async_save_sharded`'s blocking time (second save: staging buffers reused), with the pinned
   device-to-host copy of the same bytes beside them.

Each run has a time limit; a failure is recorded with its output's last lines, never a hang.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MIB = 1 << 20


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm-up: first-touch page faults, CUDA context, allocator
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copy_row(mib: int) -> dict[str, float]:
    n = mib * MIB
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    pageable = torch.empty(n, dtype=torch.uint8)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host = torch.randint(0, 255, (n,), dtype=torch.uint8)
    host_dst = torch.empty_like(host)
    copies = {
        "d2h_pageable": lambda: pageable.copy_(src),
        "d2h_pinned": lambda: pinned.copy_(src, non_blocking=True),
        "h2d_pinned": lambda: src.copy_(pinned, non_blocking=True),
        "memcpy_host": lambda: host_dst.copy_(host),
    }
    row: dict[str, float] = {"mib": mib}
    for name, fn in copies.items():
        row[name + "_gibps"] = round(n / _median_seconds(fn) / (1 << 30), 2)
    return row


def copy_bandwidth() -> list[dict[str, float]]:
    rows = []
    for mib in (256, 1024):
        rows.append(_copy_row(mib))
        print(f"copy: {rows[-1]}", flush=True)
        torch.cuda.empty_cache()
    return rows


LOGS: list[str] = []  # every run's whole output, written beside the JSON


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    LOGS.append("$ " + " ".join(cmd))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        LOGS.append(done.stdout + done.stderr)
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        LOGS.append(out + f"\n[timed out after {timeout} s]")
        return 124, LOGS[-1]


def train_runs(work: Path) -> list[dict[str, object]]:
    rows = []
    for label, extra in {
        "file": [],
        "file_async": ["--async-save"],
        "sharded": ["--sharded"],
        "sharded_async": ["--sharded", "--async-save"],
    }.items():
        row: dict[str, object] = {"backend": label}
        finals = {}
        for kind, fault in {"reference": [], "killed": ["--fail-at-step", "12"]}.items():
            out = work / f"{label}_{kind}"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=1",
                "--max-restarts=1",
                "-m",
                "refimpl.train",
                "--steps",
                "20",
                "--save-every",
                "5",
                "--ckpt-dir",
                str(out / "ckpt"),
                "--final-weights",
                str(out / "final.pt"),
                *extra,
                *fault,
            ]
            start = time.perf_counter()
            rc, text = _run(cmd, timeout=240)
            row[f"{kind}_rc"] = rc
            row[f"{kind}_s"] = round(time.perf_counter() - start, 1)
            row[f"{kind}_tail"] = text.strip().splitlines()[-6:]
            if rc == 0:
                finals[kind] = torch.load(out / "final.pt", weights_only=True)
        if len(finals) == 2:
            a, b = finals["reference"], finals["killed"]
            row["bit_identical"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        print(f"train {label}: {json.dumps(row)[:600]}", flush=True)
        rows.append(row)
    return rows


SAVE_WORKER = r"""
import json, statistics, sys, time, traceback, torch, torch.distributed as dist
from refimpl.launch import init_from_env
init_from_env()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(4)]).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
res = {"gib": round(nbytes / 2**30, 3)}
ck = sys.argv[1]
def t(fn):
    torch.cuda.synchronize(); s = time.perf_counter(); r = fn(); torch.cuda.synchronize()
    return time.perf_counter() - s, r
def section(name, fn):  # one failing part (torch 2.11's DCP) must not hide the others
    try:
        fn()
    except Exception as exc:
        res[name + "_error"] = "".join(traceback.format_exception_only(exc)).strip()[-400:]
def pinned_floor():
    bufs = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in model.parameters()]
    def copy():
        for b, p in zip(bufs, model.parameters()):
            b.copy_(p.detach(), non_blocking=True)
    copy()
    res["pinned_d2h_s"] = statistics.median(t(copy)[0] for _ in range(5))
def sharded():
    from refimpl.sharded import save_sharded, async_save_sharded
    res["sync_first_s"] = t(lambda: save_sharded(ck + "/sync", model, opt, 1))[0]
    res["sync_s"] = t(lambda: save_sharded(ck + "/sync", model, opt, 2))[0]
    h1 = async_save_sharded(ck + "/async", model, opt, 1)
    h1.result()
    blocked, h2 = t(lambda: async_save_sharded(ck + "/async", model, opt, 2))
    s = time.perf_counter(); h2.result(); res["async_blocked_s"] = blocked
    res["async_rest_s"] = time.perf_counter() - s
def files():
    from refimpl.checkpoint import AsyncCheckpointer, load_checkpoint, save_checkpoint
    sd = {"model": model.state_dict()}
    res["file_sync_s"] = t(lambda: save_checkpoint(ck + "/file", sd, 1))[0]
    ac = AsyncCheckpointer(ck + "/file_async", keep_last=2)
    ac.save(sd, 1)
    ac.wait()
    blocked, rest = [], []
    for step in range(2, 7):  # buffers reused from the second save on
        want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        b, path = t(lambda: ac.save(sd, step))
        with torch.no_grad():  # training changes the weights right after the call returns
            for p in model.parameters():
                p.add_(1.0)
        s = time.perf_counter(); ac.wait(); rest.append(time.perf_counter() - s)
        blocked.append(b)
        saved = load_checkpoint(path, keys=["model"])["model"]
        res.setdefault("file_async_snapshot_equal", True)
        res["file_async_snapshot_equal"] &= all(torch.equal(saved[k], want[k]) for k in want)
    res["file_async_blocked_s"] = statistics.median(blocked)
    res["file_async_blocked_all_s"] = blocked
    res["file_async_rest_s"] = statistics.median(rest)
    res["file_async_pinned"] = getattr(ac, "pinned_memory", None)
    ac.close()
section("pinned_floor", pinned_floor)
section("files", files)
section("sharded", sharded)
print("RESULT " + json.dumps(res), flush=True)
dist.destroy_process_group()
"""


def save_times(work: Path) -> dict[str, object]:
    script = work / "save_worker.py"
    script.write_text(SAVE_WORKER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(script),
        str(work / "save"),
    ]
    rc, text = _run(cmd, timeout=240)
    found = [line for line in text.splitlines() if line.startswith("RESULT ")]
    row: dict[str, object] = {"rc": rc}
    if found:
        row.update(json.loads(found[-1][len("RESULT ") :]))
    else:
        row["tail"] = text.strip().splitlines()[-15:]
    print(f"save: {json.dumps(row)[:1500]}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-train", action="store_true", help="only the copy and save parts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU here; run it on a machine with one")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    print(result, flush=True)
    result["copy"] = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_train:
            result["train"] = train_runs(Path(tmp))
        result["save"] = save_times(Path(tmp))
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "gpu_check_logs.txt").write_text("\n".join(LOGS) + "\n")


if __name__ == "__main__":
    main()
