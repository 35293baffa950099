"""refimpl.sharded.export_hf and the fine-tuning loads: what the ecosystem reads from a step.

Hugging Face safetensors (one file, or split with the index JSON) that
``safetensors.torch.load_file`` reads back equal to `consolidate`'s tensors; an export that a
kill cannot leave half-written; ``load_sharded`` of the model only, and with ``exclude=``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.sharded_models import fresh, trained
from safetensors.torch import load_file

import refimpl.sharded._export as export_mod
from refimpl._checkpoint_cli import main as cli_main
from refimpl.checkpoint import CheckpointError, safe_load
from refimpl.demos.sharded import tiny_model
from refimpl.sharded import consolidate, export_hf, load_sharded, save_sharded
from refimpl.sharded._export import INDEX, SINGLE, clean_name, parse_size

SRC = Path(__file__).resolve().parents[1] / "src"


def _read_export(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        part = load_file(file)
        assert not set(part) & set(tensors)  # every key in one file only
        tensors |= part
    return tensors


def _step(tmp_path: Path) -> Path:
    model, opt = trained()
    return save_sharded(tmp_path / "ckpt", model, opt, 2, state={"epoch": 3})


class Tied(torch.nn.Module):
    """An embedding and an output head that share one weight (as GPT-2's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.timeout(60)
def test_export_reads_back_as_consolidate_cast_to_the_dtype(tmp_path: Path) -> None:
    step_dir = _step(tmp_path)
    full = safe_load(consolidate(step_dir, tmp_path / "model.pt"))
    files = export_hf(step_dir, tmp_path / "hf")
    assert files == [tmp_path / "hf" / SINGLE]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [SINGLE]
    back = load_file(files[0])
    assert set(back) == set(full)  # the model only: no optimizer, no state= entries
    for name, tensor in full.items():
        assert back[name].dtype == torch.bfloat16
        assert torch.equal(back[name], tensor.to(torch.bfloat16))
    kept = load_file(export_hf(step_dir, tmp_path / "hf32", dtype=None)[0])
    assert all(torch.equal(kept[k], full[k]) for k in full)  # dtype=None: bit-identical
    tiny_model(9).load_state_dict(kept)  # loads into an unwrapped model


@pytest.mark.timeout(60)
def test_tied_weights_export_as_copies(tmp_path: Path) -> None:
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_dir = save_sharded(tmp_path / "ckpt", model, opt, 1)
    back = load_file(export_hf(step_dir, tmp_path / "hf", dtype=torch.float32)[0])
    assert set(back) == {"emb.weight", "head.weight"}
    assert torch.equal(back["emb.weight"], model.emb.weight.detach())
    assert torch.equal(back["head.weight"], model.emb.weight.detach())


def test_names_lose_wrapper_parts_and_sizes_parse() -> None:
    assert clean_name("module._orig_mod.layers.0.weight") == "layers.0.weight"
    assert clean_name("layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    assert clean_name("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.w") == "layers.0.w"
    assert clean_name("encoder.module.w") == "encoder.module.w"  # only DDP's leading module.
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError, match="not a size"):
        parse_size("2 gigs")


@pytest.mark.timeout(60)
def test_split_export_has_an_index_covering_every_key_once(tmp_path: Path) -> None:
    step_dir = _step(tmp_path)
    full = safe_load(consolidate(step_dir, tmp_path / "model.pt", dtype=torch.bfloat16))
    limit = 270  # bf16 bytes: 0.weight 480 (alone), 0.bias 40, 2.weight 240 + 2.bias 12
    files = export_hf(step_dir, tmp_path / "hf", max_shard_bytes=limit)
    names = [f.name for f in files]
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [INDEX]
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert sorted(index["weight_map"]) == sorted(full)  # every key exactly once (a dict)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in full.values())
    for file in files[:-1]:
        part = load_file(file)
        assert all(index["weight_map"][k] == file.name for k in part)
        nbytes = sum(t.numel() * t.element_size() for t in part.values())
        assert nbytes <= limit or len(part) == 1, (file.name, nbytes)
    back = _read_export(tmp_path / "hf")
    assert all(torch.equal(back[k], full[k]) for k in full)
    one = export_hf(step_dir, tmp_path / "hf1", max_shard_bytes="1MB")  # fits: not split
    assert [f.name for f in one] == [SINGLE]


@pytest.mark.timeout(60)
def test_a_failure_mid_export_leaves_the_previous_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step_dir = _step(tmp_path)
    out = tmp_path / "hf"
    real = export_mod._save_file
    calls = []

    def dies_after_one(tensors: dict[str, torch.Tensor], path: Path) -> None:
        if calls:
            raise OSError(28, "No space left on device (injected)")
        calls.append(path)
        real(tensors, path)

    monkeypatch.setattr(export_mod, "_save_file", dies_after_one)
    with pytest.raises(OSError, match="injected"):
        export_hf(step_dir, out, max_shard_bytes=270)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no export, no temporary
    monkeypatch.setattr(export_mod, "_save_file", real)
    export_hf(step_dir, out, max_shard_bytes=270)
    (out / "config.json").write_text('{"model_type": "mlp"}')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls.clear()
    monkeypatch.setattr(export_mod, "_save_file", dies_after_one)
    with pytest.raises(OSError, match="injected"):
        export_hf(step_dir, out, dtype=torch.float16, max_shard_bytes=270)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]
    monkeypatch.setattr(export_mod, "_save_file", real)
    export_hf(step_dir, out, dtype=torch.float16)  # re-export, now one file
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SINGLE]  # config kept
    assert all(t.dtype == torch.float16 for t in load_file(out / SINGLE).values())


@pytest.mark.timeout(90)
def test_a_kill_mid_export_leaves_no_complete_looking_export(tmp_path: Path) -> None:
    step_dir = _step(tmp_path)
    out = tmp_path / "hf"
    script = textwrap.dedent(f"""
        import os, signal
        import refimpl.sharded._export as m
        real = m._save_file
        def save_then_die(tensors, path):
            real(tensors, path)
            os.kill(os.getpid(), signal.SIGKILL)  # after the first file is on disk
        m._save_file = save_then_die
        m.export_hf({str(step_dir)!r}, {str(out)!r}, max_shard_bytes=270)
    """)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=80, check=False)
    assert proc.returncode == -9
    assert not out.exists()  # nothing under the export's name
    temps = [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp-")]
    assert len(temps) == 1 and len(list(temps[0].glob("*.safetensors"))) == 1  # hidden
    assert not (temps[0] / INDEX).exists()
    export_hf(step_dir, out, max_shard_bytes=270)  # the next export reaps the dead one's temp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]
    assert len(json.loads((out / INDEX).read_text())["weight_map"]) == 4


@pytest.mark.timeout(60)
def test_export_refuses_a_bad_step_and_the_cli_exports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step_dir = _step(tmp_path)
    assert (
        cli_main(["export-hf", str(step_dir), str(tmp_path / "hf"), "--max-shard-size", "270B"])
        == 0
    )
    assert "model-00003-of-00003.safetensors" in capsys.readouterr().out
    assert len(_read_export(tmp_path / "hf")) == 4
    assert cli_main(["export-hf", str(step_dir), str(tmp_path / "f32"), "--dtype", "keep"]) == 0
    assert load_file(tmp_path / "f32" / SINGLE)["0.weight"].dtype == torch.float32
    with pytest.raises(ValueError, match="inside the step"):
        export_hf(step_dir, step_dir / "hf")
    capsys.readouterr()
    assert cli_main(["export-hf", str(step_dir), str(step_dir.parent)]) == 1  # before: raised
    assert capsys.readouterr().out.startswith(f"REFUSED  {step_dir.parent} holds the step")
    (step_dir / "COMMITTED").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        export_hf(step_dir, tmp_path / "never")
    assert cli_main(["export-hf", str(step_dir), str(tmp_path / "never")]) == 1
    assert not (tmp_path / "never").exists()


@pytest.mark.timeout(60)
def test_model_only_load_leaves_optimizer_and_state_alone(tmp_path: Path) -> None:
    model, opt = trained()
    save_sharded(tmp_path / "ckpt", model, opt, 2, state={"epoch": 3})
    target, target_opt = fresh()
    state = {"epoch": 0}
    assert load_sharded(tmp_path / "ckpt", target) == 2  # no optimizer, no state=
    assert all(
        torch.equal(a, b) for a, b in zip(target.parameters(), model.parameters(), strict=True)
    )
    assert target_opt.state_dict()["state"] == {}  # never touched
    assert state == {"epoch": 0}


@pytest.mark.timeout(60)
def test_exclude_keeps_the_excluded_and_loads_the_rest(tmp_path: Path) -> None:
    model, opt = trained()
    save_sharded(tmp_path / "ckpt", model, opt, 2)
    for exclude in (["2"], [re.compile(r"2\.(weight|bias)")], ["2.weight", "2.bias"]):
        target, target_opt = fresh()
        head = [p.detach().clone() for p in target[2].parameters()]
        assert load_sharded(tmp_path / "ckpt", target, target_opt, exclude=exclude) == 2
        assert torch.equal(target[0].weight, model[0].weight)
        assert torch.equal(target[0].bias, model[0].bias)
        assert all(torch.equal(a, b) for a, b in zip(target[2].parameters(), head, strict=True))
        moments = target_opt.state[target[0].weight]["exp_avg"]
        assert torch.equal(moments, opt.state[model[0].weight]["exp_avg"])
        kept = target_opt.state[target[2].weight]["exp_avg"]  # its own, not the step's
        assert not torch.equal(kept, opt.state[model[2].weight]["exp_avg"])
    # A fine-tune with a new vocabulary: a head of another shape loads the rest.
    new_vocab = torch.nn.Sequential(*list(tiny_model(5))[:2], torch.nn.Linear(20, 9))
    head = new_vocab[2].weight.detach().clone()
    load_sharded(tmp_path / "ckpt", new_vocab, exclude=["2"])
    assert torch.equal(new_vocab[0].weight, model[0].weight)
    assert torch.equal(new_vocab[2].weight, head)
    with pytest.raises(ValueError, match="names no key"):
        load_sharded(tmp_path / "ckpt", fresh()[0], exclude=["head"])
    with pytest.raises(TypeError, match="list"):
        load_sharded(tmp_path / "ckpt", fresh()[0], exclude="2")  # type: ignore[arg-type]


def _entries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "where", ["root", "dot", "above", "other-step", "link-to-root", "holds-a-root"]
)
def test_export_never_replaces_a_checkpoint_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An export replaces its directory whole: over the checkpoint root, a step committed
    while it ran would be lost although its save returned."""
    model, opt = trained()
    root = tmp_path / "ckpt"
    save_sharded(root, model, opt, 1)
    step2 = save_sharded(root, model, opt, 2)
    (tmp_path / "elsewhere").mkdir()
    out = {
        "root": root,
        "dot": Path("."),
        "above": tmp_path,
        "other-step": root / "step_00000001",
        "link-to-root": tmp_path / "link",
        "holds-a-root": tmp_path / "elsewhere",
    }[where]
    (tmp_path / "link").symlink_to(root, target_is_directory=True)
    if where == "holds-a-root":
        save_sharded(tmp_path / "elsewhere" / "run2", model, opt, 7)
    monkeypatch.chdir(root)
    real = export_mod._save_file

    def a_save_commits_meanwhile(tensors: dict[str, torch.Tensor], path: Path) -> None:
        save_sharded(root, model, opt, 3)  # another process's save, during the export
        real(tensors, path)

    monkeypatch.setattr(export_mod, "_save_file", a_save_commits_meanwhile)
    before = _entries(tmp_path)
    with pytest.raises(ValueError, match=r"holds the step|is or holds a checkpoint"):
        export_hf(step2, out)  # before: returned, and step_00000003 was gone
    assert _entries(tmp_path) == before  # nothing written, nothing removed


@pytest.mark.timeout(60)
def test_export_through_a_symlink_replaces_its_target_and_keeps_the_link(
    tmp_path: Path,
) -> None:
    step_dir = _step(tmp_path)
    real_dir = tmp_path / "models" / "mlp"
    real_dir.mkdir(parents=True)
    (real_dir / "config.json").write_text("{}")
    link = tmp_path / "hf"
    link.symlink_to(real_dir, target_is_directory=True)
    files = export_hf(step_dir, link)
    assert files == [link / SINGLE]
    assert link.is_symlink() and os.readlink(link) == str(real_dir)  # before: a directory
    assert sorted(p.name for p in real_dir.iterdir()) == ["config.json", SINGLE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "models"]
