"""Random numbers and checkpoints: seeded reproducibility of every random op on superchip,
``torch.Generator(device="superchip")``, RNG state round trips, and ``torch.save``/``torch.load``
with ``map_location`` in both directions."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

import superchip  # noqa: F401

from helpers import DEVICE

RANDOM_OPS = {
    "randn": lambda g: torch.randn(100, device=DEVICE, generator=g),
    "rand": lambda g: torch.rand(100, device=DEVICE, generator=g),
    "randint": lambda g: torch.randint(0, 1000, (100,), device=DEVICE, generator=g),
    "randperm": lambda g: torch.randperm(50, device=DEVICE, generator=g),
    "normal_": lambda g: torch.empty(100, device=DEVICE).normal_(2.0, 3.0, generator=g),
    "uniform_": lambda g: torch.empty(100, device=DEVICE).uniform_(-1, 1, generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((100,), 0.5, device=DEVICE),
                                           generator=g),
    "multinomial": lambda g: torch.multinomial(torch.ones(20, device=DEVICE), 10,
                                               generator=g),
    "dropout": lambda g: torch.nn.functional.dropout(torch.ones(100, device=DEVICE), 0.5),
}


@pytest.mark.parametrize("name", list(RANDOM_OPS))
def test_manual_seed_reproducibility(name):
    op = RANDOM_OPS[name]
    torch.manual_seed(42)
    a = op(None)
    b = op(None)
    torch.manual_seed(42)
    c = op(None)
    assert a.device == DEVICE
    assert torch.equal(a.cpu(), c.cpu()), "same seed gave different numbers"
    assert not torch.equal(a.cpu(), b.cpu()), "two draws without reseeding were equal"
    torch.manual_seed(43)
    assert not torch.equal(op(None).cpu(), a.cpu()), "another seed gave the same numbers"


@pytest.mark.parametrize("name", [n for n in RANDOM_OPS if n != "dropout"])
def test_generator_object(name):
    op = RANDOM_OPS[name]
    g = torch.Generator(device="superchip")
    assert g.device == DEVICE
    g.manual_seed(7)
    assert g.initial_seed() == 7
    a = op(g)
    torch.manual_seed(999)  # the default generator does not affect an explicit one
    g.manual_seed(7)
    b = op(g)
    assert torch.equal(a.cpu(), b.cpu())


def test_generator_of_other_device_rejected():
    # As for CUDA: "Expected a 'cuda' device type for generator but found 'cpu'".
    with pytest.raises(RuntimeError, match="generator"):
        torch.randn(3, device=DEVICE, generator=torch.Generator())
    with pytest.raises(RuntimeError, match="generator"):
        torch.randn(3, generator=torch.Generator(device="superchip"))


def test_random_values_are_distributed_sensibly():
    torch.manual_seed(0)
    x = torch.randn(20000, device=DEVICE).cpu()
    assert abs(x.mean().item()) < 0.05 and abs(x.std().item() - 1) < 0.05
    u = torch.rand(20000, device=DEVICE).cpu()
    assert u.min().item() >= 0 and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.02
    p = torch.randperm(1000, device=DEVICE).cpu()
    assert torch.equal(p.sort().values, torch.arange(1000))


def test_rng_state_round_trip():
    torch.manual_seed(3)
    state = torch.superchip.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = torch.randn(10, device=DEVICE)
    torch.superchip.set_rng_state(state)
    b = torch.randn(10, device=DEVICE)
    assert torch.equal(a.cpu(), b.cpu())
    states = torch.superchip.get_rng_state_all()
    assert len(states) == torch.superchip.device_count()
    c = torch.rand(5, device=DEVICE)
    torch.superchip.set_rng_state_all(states)
    assert torch.equal(torch.rand(5, device=DEVICE).cpu(), c.cpu())


def test_generator_state_round_trip_and_seeds():
    g = torch.Generator(device="superchip").manual_seed(11)
    st = g.get_state()
    a = torch.rand(8, device=DEVICE, generator=g)
    g.set_state(st)
    assert torch.equal(torch.rand(8, device=DEVICE, generator=g).cpu(), a.cpu())
    torch.superchip.manual_seed(5)
    assert torch.superchip.initial_seed() == 5
    x = torch.randn(4, device=DEVICE)
    torch.superchip.manual_seed_all(5)
    assert torch.equal(torch.randn(4, device=DEVICE).cpu(), x.cpu())


def test_fork_rng_restores_superchip_state():
    torch.manual_seed(1)
    with torch.random.fork_rng(device_type="superchip"):
        torch.randn(10, device=DEVICE)
    a = torch.randn(10, device=DEVICE)
    torch.manual_seed(1)
    assert torch.equal(torch.randn(10, device=DEVICE).cpu(), a.cpu())


# ---- serialization ----


def _roundtrip(obj, map_location=None):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, map_location=map_location, weights_only=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_save_load_tensor(dtype):
    t = (torch.randn(3, 5) * 5).to(dtype).to(DEVICE)
    loaded = _roundtrip(t)
    assert loaded.device == DEVICE and loaded.dtype == dtype
    assert torch.equal(loaded.cpu(), t.cpu())
    assert loaded.data_ptr() != t.data_ptr()
    cpu = _roundtrip(t, map_location="cpu")
    assert cpu.device.type == "cpu" and torch.equal(cpu, t.cpu())


def test_load_cpu_checkpoint_onto_superchip():
    t = torch.randn(4, 4)
    loaded = _roundtrip({"w": t, "step": 3}, map_location="superchip")
    assert loaded["step"] == 3
    assert loaded["w"].device == DEVICE and torch.equal(loaded["w"].cpu(), t)
    loaded2 = _roundtrip(t, map_location=DEVICE)
    assert loaded2.device == DEVICE


def test_save_load_preserves_view_sharing():
    base = torch.arange(10.0, device=DEVICE)
    view = base[2:5]
    lb, lv = _roundtrip((base, view))
    assert lv.untyped_storage().data_ptr() == lb.untyped_storage().data_ptr()
    lv.fill_(-1)
    assert lb.cpu()[2:5].tolist() == [-1.0, -1.0, -1.0]


def test_save_load_state_dict_and_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(DEVICE)
    model(torch.randn(6, 4, device=DEVICE))  # updates BatchNorm running stats
    sd = _roundtrip(model.state_dict())
    for k, v in model.state_dict().items():
        assert sd[k].device == DEVICE, k
        assert torch.equal(sd[k].cpu(), v.cpu()), k
    fresh = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(DEVICE)
    fresh.load_state_dict(sd)
    x = torch.randn(3, 4, device=DEVICE)
    model.eval()
    fresh.eval()
    assert torch.equal(fresh(x).cpu(), model(x).cpu())

    whole = _roundtrip(model)
    assert next(whole.parameters()).device == DEVICE
    assert torch.equal(whole(x).cpu(), model(x).cpu())

    cpu_sd = _roundtrip(model.state_dict(), map_location="cpu")
    assert all(v.device.type == "cpu" for v in cpu_sd.values())
    cpu_model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    cpu_model.load_state_dict(cpu_sd)
    cpu_model.eval()
    torch.testing.assert_close(cpu_model(x.cpu()), model(x).cpu())


def test_save_load_optimizer_state_to_file(tmp_path):
    model = nn.Linear(3, 3).to(DEVICE)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, device=DEVICE)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    ck = torch.load(path, map_location="superchip")
    exp_avg = ck["opt"]["state"][0]["exp_avg"]
    assert exp_avg.device == DEVICE
    assert torch.equal(exp_avg.cpu(), opt.state_dict()["state"][0]["exp_avg"].cpu())
    ck_cpu = torch.load(path, map_location="cpu")
    assert ck_cpu["opt"]["state"][0]["exp_avg"].device.type == "cpu"
    assert torch.equal(ck_cpu["model"]["weight"], model.weight.detach().cpu())


def test_dropout_follows_the_superchip_generator():
    # native_dropout has no generator argument: it must still draw from the superchip stream,
    # so seeding or restoring torch.superchip's state reproduces the mask.
    x = torch.ones(64, 64, device="superchip")
    torch.superchip.manual_seed(7)
    first = torch.nn.functional.dropout(x, 0.5).cpu()
    torch.superchip.manual_seed(7)
    second = torch.nn.functional.dropout(x, 0.5).cpu()
    assert torch.equal(first, second)
    state = torch.superchip.get_rng_state()
    third = torch.nn.functional.dropout(x, 0.5).cpu()
    torch.superchip.set_rng_state(state)
    assert torch.equal(torch.nn.functional.dropout(x, 0.5).cpu(), third)
    assert not torch.equal(first, third)
