"""Full training state: weights-only loadable, RNGs restored, DDP prefix gone, safetensors."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from refimpl.checkpoint import load_latest, safe_load, save_checkpoint, verify_checkpoint
from refimpl.state import (
    ACCUMULATION_KEYS,
    STATE_KEYS,
    capture_rng,
    capture_state,
    export_safetensors,
    restore_rng,
    restore_state,
    unwrap_model,
    unwrap_state_dict,
)


class _Wrapped(torch.nn.Module):  # what DDP looks like to state_dict: a `module` attribute
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.module = inner


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, object, torch.amp.GradScaler]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(m(torch.randn(8, 16)).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    return m, opt, sched, scaler


def test_rng_round_trip_through_weights_only_load(tmp_path: Path) -> None:
    torch.save(capture_rng(), tmp_path / "rng.pt")
    a = (random.random(), float(np.random.rand()), torch.rand(3).tolist())
    restore_rng(safe_load(tmp_path / "rng.pt"))
    assert (random.random(), float(np.random.rand()), torch.rand(3).tolist()) == a


def test_rng_checkpoint_size_does_not_depend_on_the_rng_state(tmp_path: Path) -> None:
    # pickle sizes an int by its value; a tuple of 625 ints gave every run a different file size
    # (CI saw 64 bytes of difference in chapter 6's size table). The tensor form is fixed-size.
    sizes = set()
    for seed in range(6):
        random.seed(seed)
        np.random.seed(seed)
        torch.save(capture_rng(), tmp_path / f"rng{seed}.pt")
        sizes.add((tmp_path / f"rng{seed}.pt").stat().st_size)
    assert len(sizes) == 1, sizes


def test_rng_restores_the_older_tuple_form() -> None:
    old = capture_rng()
    old["python"] = random.getstate()  # how refimpl 0.1.0 stored it
    a = random.random()
    restore_rng(old)
    assert random.random() == a


def test_unwrap_removes_module_prefix() -> None:
    inner = torch.nn.Linear(2, 2)
    assert list(_Wrapped(inner).state_dict()) == ["module.weight", "module.bias"]
    assert list(unwrap_state_dict(_Wrapped(inner))) == ["weight", "bias"]


def test_full_state_round_trip_via_checkpoint(tmp_path: Path) -> None:
    m, opt, sched, scaler = _trained()
    state = capture_state(
        _Wrapped(m),
        opt,
        scheduler=sched,
        scaler=scaler,
        sampler_state={"seed": 0, "epoch": 1, "position": 24},
        epoch=1,
        step=3,
        world_size=2,
    )
    save_checkpoint(tmp_path, state, step=3)
    found = load_latest(tmp_path, map_location="cpu")
    assert found is not None
    m2, opt2, sched2, scaler2 = _trained()
    torch.nn.init.zeros_(m2[0].weight)
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    info = restore_state(found[1], m2, opt2, scheduler=sched2, scaler=scaler2)
    assert info == {
        "epoch": 1,
        "step": 3,
        "world_size": 2,
        "micro_step": 0,
        "sampler": {"seed": 0, "epoch": 1, "position": 24},
        "extra": {},
        "rng_restored": True,
    }
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    assert sched2.state_dict() == sched.state_dict()
    assert scaler2.get_scale() == scaler.get_scale()
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)


def test_per_rank_rng_list_restores_own_rank() -> None:
    torch.manual_seed(1)
    r0 = capture_rng()
    torch.manual_seed(2)
    r1 = capture_rng()
    expected = torch.rand(2)
    m, opt, _, _ = _trained()
    state = capture_state(m, opt, rng=[r0, r1])
    restore_state(state, m, rank=1)
    assert torch.equal(torch.rand(2), expected)


def test_safetensors_export_is_half_precision_unwrapped(tmp_path: Path) -> None:
    m, _, _, _ = _trained()
    path = export_safetensors(_Wrapped(m), tmp_path / "model.safetensors")
    loaded = load_file(path)
    assert set(loaded) == set(m.state_dict()) and loaded["0.weight"].dtype == torch.float16
    n_params = sum(p.numel() for p in m.parameters())
    assert 2 * n_params <= path.stat().st_size < 2 * n_params + 1024  # header only on top


def test_per_rank_rng_list_not_restored_on_other_world_size() -> None:
    m, opt, _, _ = _trained()
    torch.manual_seed(1)
    state = capture_state(m, opt, rng=[capture_rng(), capture_rng()])
    torch.manual_seed(7)
    expected = torch.rand(2)
    torch.manual_seed(7)
    restore_state(state, m, rank=1, world_size=4)
    assert torch.equal(torch.rand(2), expected)


# --- issue 24 item 3: the user's own keys are part of the API ----------------------------------


def test_user_keys_travel_through_a_checkpoint_and_come_back_as_extra(tmp_path: Path) -> None:
    m, opt, _, _ = _trained()
    model_args = {"n_layer": 2, "n_embd": 32, "bias": False}
    state = capture_state(m, opt, step=5, extra={"best_val_loss": 1.25, "model_args": model_args})
    assert set(state) == {*STATE_KEYS, "best_val_loss", "model_args"}
    state["config"] = {"lr": 3e-4, "dataset": "shakespeare_char"}  # set on the dict: same thing
    save_checkpoint(tmp_path, state, step=5)
    manifest = verify_checkpoint(tmp_path / "step_00000005")
    assert sorted(manifest["keys"]) == sorted(state)  # every key is saved, the user's included
    found = load_latest(tmp_path)
    assert found is not None
    info = restore_state(found[1], m, opt)
    assert info["extra"] == {
        "best_val_loss": 1.25,
        "model_args": model_args,
        "config": {"lr": 3e-4, "dataset": "shakespeare_char"},
    }
    assert info["step"] == 5 and info["rng_restored"]


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("step", "capture_state writes itself"),
        ("rng", "capture_state writes itself"),
        ("grads", "capture_state writes itself"),
        ("a/b", "file-name-safe|letters, digits"),
        (".hidden", "letters, digits"),
        (3, "letters, digits"),
    ],
)
def test_a_user_key_that_would_clash_or_not_save_is_refused(key: object, why: str) -> None:
    m, opt, _, _ = _trained()
    with pytest.raises(ValueError, match=why):
        capture_state(m, opt, extra={key: 1.0})  # type: ignore[dict-item]


def test_rng_restored_says_whether_this_rank_got_its_stream_back() -> None:
    m, opt, _, _ = _trained()
    both = capture_state(m, opt, rng=[capture_rng(), capture_rng()], world_size=2)
    assert restore_state(both, m, rank=1, world_size=2)["rng_restored"]
    assert not restore_state(both, m, rank=1, world_size=3)["rng_restored"]
    assert not restore_state(both, m, rank=2)["rng_restored"]  # no such saved rank
    assert not restore_state({**both, "rng": None}, m)["rng_restored"]
    assert restore_state(capture_state(m, opt), m)["rng_restored"]  # one state: restored as is


def test_compiled_models_state_loads_into_an_uncompiled_one_and_back() -> None:
    """torch.compile wraps the model in an OptimizedModule whose state-dict keys start with
    ``_orig_mod.`` (no forward pass needed to see it). The captured state has the bare keys and
    restores into a compiled model and into a bare one; a state dict saved by other code with
    the prefix (nanoGPT's raw ``model.state_dict()``) restores into a bare model too."""
    torch.manual_seed(0)
    bare = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    compiled = torch.compile(bare)
    assert isinstance(compiled, torch.nn.Module)
    assert next(iter(compiled.state_dict())) == "_orig_mod.0.weight"
    assert unwrap_model(compiled) is bare and unwrap_model(torch.compile(_Wrapped(bare))) is bare
    state = capture_state(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
    assert list(state["model"]) == list(bare.state_dict())
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    restore_state(state, torch.compile(other))  # into a compiled one
    assert all(
        torch.equal(a, b) for a, b in zip(bare.parameters(), other.parameters(), strict=True)
    )
    torch.nn.init.zeros_(other[0].weight)
    restore_state({**state, "model": compiled.state_dict()}, other)  # prefixed, into a bare one
    assert torch.equal(other[0].weight, bare[0].weight)


def test_gradients_travel_only_with_a_micro_step_and_refuse_another_world_size() -> None:
    """micro_step=0 adds no key (the state is the same as before); micro_step>0 saves the
    gradients and restores them into .grad; a per-rank list of them is refused at another
    world size before anything is loaded."""
    m, opt, _, _ = _trained()
    assert set(capture_state(m, opt)) == set(STATE_KEYS)
    m(torch.ones(1, 16)).sum().backward()
    state = capture_state(m, opt, micro_step=3)
    assert set(state) == {*STATE_KEYS, *ACCUMULATION_KEYS} and state["micro_step"] == 3
    assert set(state["grads"]) == {n for n, _ in m.named_parameters()}
    expected = m[0].weight.grad.clone()  # type: ignore[union-attr]
    opt.zero_grad(set_to_none=True)
    assert restore_state(state, m)["micro_step"] == 3
    assert torch.equal(m[0].weight.grad, expected)  # type: ignore[arg-type]
    both = capture_state(m, opt, micro_step=1, grads=[state["grads"], state["grads"]])
    torch.nn.init.zeros_(m[0].weight)
    with pytest.raises(ValueError, match="by 2 ranks, and this run has world size 3"):
        restore_state(both, m, rank=0, world_size=3)
    assert not m[0].weight.any()  # refused before the weights were loaded
