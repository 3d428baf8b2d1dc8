"""Lightning's Trainer and Fabric on superchip (python/superchip/_lightning.py): the
"superchip" accelerator, "auto" choosing it, mixed precision autocasting on it, and DDP over
superchip devices. Each run is compared with the same run on Lightning's CPU accelerator: bit
for bit on the CPU executor.

Needs `lightning` (scripts/setup.sh installs it).
"""

from __future__ import annotations

import json

import pytest
import torch

import superchip

from helpers import run_python

L = pytest.importorskip("lightning")

BITWISE = superchip.executor() == "cpu"


class _Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 1))
        self.seen = set()
        self.losses = []

    def training_step(self, batch, i):
        x, y = batch
        out = self.net(x)
        self.seen.add((str(x.device), str(out.dtype)))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, foreach=False)


def _fit(accelerator, precision):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
    L.seed_everything(0, verbose=False)
    module = _Module()
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_epochs=2, precision=precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16, shuffle=True))
    return module, trainer


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("accelerator", ["superchip", "auto"])
def test_trainer_trains_on_superchip_with_the_cpus_bits(accelerator, precision):
    # Note [Lightning's accelerator]: Lightning knew no superchip accelerator ("invalid
    # accelerator name"), and with "auto" it trained a superchip module on the CPU; its mixed
    # precision autocast "cuda" for any accelerator but the CPU and MPS.
    want, _ = _fit("cpu", precision)
    got, trainer = _fit(accelerator, precision)
    dtype = "torch.float32" if precision == "32-true" else "torch.bfloat16"
    assert got.seen == {("superchip:0", dtype)}, got.seen
    assert trainer.accelerator.name() == "superchip" and trainer.strategy.root_device == torch.device("superchip", 0)
    if precision != "32-true":
        assert trainer.precision_plugin.device == "superchip"
    if BITWISE:
        assert got.losses == want.losses
        assert all(torch.equal(a, b) for a, b in zip(want.parameters(), got.parameters()))
    else:
        assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-3) for a, b in zip(want.parameters(), got.parameters()))


def test_trainer_fp16_scales_losses_on_superchip():
    got, trainer = _fit("superchip", "16-mixed")
    assert got.seen == {("superchip:0", "torch.float16")}, got.seen
    scaler = trainer.precision_plugin.scaler
    assert trainer.precision_plugin.device == "superchip" and scaler.is_enabled() and scaler._device == "superchip"
    assert all(torch.isfinite(torch.tensor(got.losses)))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fabric_runs_on_superchip_with_the_cpus_bits(precision):
    def run(accelerator):
        fabric = L.Fabric(accelerator=accelerator, devices=1, precision=precision)
        fabric.seed_everything(0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        model, opt = fabric.setup(model, opt)
        g = torch.Generator().manual_seed(0)
        for _ in range(4):
            x, y = fabric.to_device(torch.randn(8, 16, generator=g)), fabric.to_device(torch.randn(8, 1, generator=g))
            fabric.backward(torch.nn.functional.mse_loss(model(x).float(), y))
            opt.step()
            opt.zero_grad()
        return fabric.device, [p.detach().cpu() for p in model.parameters()]

    _, want = run("cpu")
    for accelerator in ("superchip", "auto"):
        device, got = run(accelerator)
        assert device == torch.device("superchip", 0), accelerator
        if BITWISE:
            assert all(torch.equal(a, b) for a, b in zip(want, got)), accelerator


def test_the_accelerator_pickles_for_spawned_processes():
    # strategy="ddp_spawn" pickles the accelerator for its processes; the class is made at run
    # time and was not found by name ("Can't pickle <class ...SuperchipAccelerator>").
    import pickle

    import lightning.fabric

    for accelerator in (L.Trainer(accelerator="superchip", logger=False).accelerator,
                        lightning.fabric.Fabric(accelerator="superchip").accelerator):
        again = pickle.loads(pickle.dumps(accelerator))
        assert type(again) is type(accelerator) and again.name() == "superchip"


@pytest.mark.skipif(torch.superchip.device_count() != 1, reason="counts one device")
def test_devices_past_the_count_are_refused_by_name():
    with pytest.raises(ValueError, match=r"names superchip device\(s\) \[1\] but this process has 1"):
        L.Trainer(accelerator="superchip", devices=[1], logger=False)
    with pytest.raises(ValueError, match=r"devices=2 names superchip device\(s\) \[1\] but this process has 1"):
        L.Trainer(accelerator="superchip", devices=2, logger=False)


_DDP_SCRIPT = """
import json, os, sys, warnings
import lightning as L  # before superchip: the registration waits for nothing
import torch
import superchip
warnings.filterwarnings("ignore")

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.seen = set()
    def training_step(self, batch, i):
        x, y = batch
        self.seen.add(str(x.device))
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)
    def on_train_end(self):
        out = dict(seen=sorted(self.seen), world=self.trainer.world_size,
                   backend=torch.distributed.get_backend(), wrapped=type(self.trainer.strategy.model).__name__,
                   params=[p.detach().cpu().tolist() for p in self.parameters()])
        with open(os.path.join(sys.argv[2], f"{sys.argv[1]}-{self.global_rank}.json"), "w") as f:
            json.dump(out, f)

g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
L.seed_everything(0, verbose=False)
trainer = L.Trainer(accelerator=sys.argv[1], devices=2, strategy="ddp", max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=8))
"""


@pytest.mark.skipif(superchip.executor() == "cuda" and torch.superchip.device_count() < 2,
                    reason="two ranks need two GPUs with the CUDA executor")
def test_ddp_over_two_superchip_devices_gives_the_cpu_ddp_bits(tmp_path):
    # Lightning's DDP picked the backend "sccl" alone (no Gloo for its CPU tensors) and passed
    # device_ids with a torch.cuda.Stream for any device but the CPU ("torch.cuda.Stream
    # requires CUDA support"). Two processes each, launched by Lightning itself.
    script = tmp_path / "ddp.py"
    script.write_text(_DDP_SCRIPT)
    env = {"SUPERCHIP_DEVICE_COUNT": "2", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for accelerator in ("superchip", "cpu"):
        r = run_python(f"import runpy, sys; sys.argv = {[str(script), accelerator, str(tmp_path)]!r}; "
                       "runpy.run_path(sys.argv[0], run_name='__main__')", env=env, timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = {(a, rank): json.loads((tmp_path / f"{a}-{rank}.json").read_text())
           for a in ("superchip", "cpu") for rank in (0, 1)}
    for rank in (0, 1):
        got, want = out[("superchip", rank)], out[("cpu", rank)]
        assert got["seen"] == [f"superchip:{rank}"] and got["world"] == 2, got
        assert got["backend"] == "cpu:gloo,superchip:sccl" and got["wrapped"] == "DistributedDataParallel", got
        if BITWISE:
            assert got["params"] == want["params"], rank
    assert out[("superchip", 0)]["params"] == out[("superchip", 1)]["params"]
