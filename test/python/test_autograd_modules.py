"""Forward and backward of common modules on superchip against the same module on CPU.

The module is built once on CPU, deep-copied to superchip, both run the same input, and the
outputs, input gradients and parameter gradients are compared with the float32 row of the
tolerance table (with the CPU executor the kernels are the CPU kernels, so most results are
bitwise equal).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import superchip

from helpers import DEVICE, assert_close_cpu


def _parity(module: nn.Module, *inputs: torch.Tensor, seed: int | None = None,
            train: bool = True):
    """Runs ``module`` on CPU and a copy on superchip; compares outputs and all gradients."""
    ref = module.train(train)
    dev = copy.deepcopy(module).to(DEVICE).train(train)
    cpu_in = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    dev_in = [x.to(DEVICE).requires_grad_(x.is_floating_point()) for x in inputs]

    if seed is not None:
        torch.manual_seed(seed)
    out_cpu = ref(*cpu_in)
    if seed is not None:
        torch.manual_seed(seed)
    out_dev = dev(*dev_in)
    assert out_dev.device == DEVICE
    assert_close_cpu(out_dev, out_cpu.detach())

    grad_out = torch.randn_like(out_cpu)
    out_cpu.backward(grad_out)
    out_dev.backward(grad_out.to(DEVICE))
    for x_cpu, x_dev in zip(cpu_in, dev_in):
        if x_cpu.grad is not None:
            assert x_dev.grad is not None
            assert_close_cpu(x_dev.grad, x_cpu.grad)
    for (name, p_cpu), (_, p_dev) in zip(ref.named_parameters(), dev.named_parameters()):
        assert p_dev.grad is not None, f"no gradient for {name}"
        assert p_dev.grad.device == DEVICE
        assert_close_cpu(p_dev.grad, p_cpu.grad, msg=f"gradient of {name}")
    for (name, b_cpu), (_, b_dev) in zip(ref.named_buffers(), dev.named_buffers()):
        assert_close_cpu(b_dev, b_cpu, msg=f"buffer {name}")
    return out_cpu, out_dev


def test_linear():
    torch.manual_seed(1)
    _parity(nn.Linear(16, 8), torch.randn(4, 16))


def test_linear_3d_input_no_bias():
    torch.manual_seed(1)
    _parity(nn.Linear(16, 8, bias=False), torch.randn(2, 3, 16))


def test_conv2d():
    torch.manual_seed(2)
    _parity(nn.Conv2d(3, 4, kernel_size=3, padding=1, stride=2), torch.randn(2, 3, 9, 9))


def test_layer_norm():
    torch.manual_seed(3)
    ln = nn.LayerNorm(10)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    _parity(ln, torch.randn(4, 5, 10))


def test_embedding():
    torch.manual_seed(4)
    emb = nn.Embedding(20, 6, padding_idx=0)
    idx = torch.tensor([[1, 2, 0, 19], [2, 2, 5, 7]])
    out_cpu, out_dev = _parity(emb, idx)
    assert out_dev.shape == (2, 4, 6)


class _SDPA(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


@pytest.mark.parametrize("causal", [False, True])
def test_scaled_dot_product_attention(causal):
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    _parity(_SDPA(causal), q, k, v)


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm(train):
    torch.manual_seed(6)
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    _parity(bn, torch.randn(3, 4, 5, 5), train=train)  # running stats compared as buffers


def test_batch_norm_1d():
    torch.manual_seed(6)
    _parity(nn.BatchNorm1d(8), torch.randn(16, 8))


def test_dropout_p0_is_identity():
    x = torch.randn(5, 6)
    out_cpu, out_dev = _parity(nn.Dropout(p=0.0), x)
    torch.testing.assert_close(out_dev.detach().cpu(), x, rtol=0, atol=0)


# Random masks equal the CPU's only where the CPU's generator draws them: the CPU executor. The
# CUDA executor's default generator is CUDA's own, so there the mask is plain CUDA's
# (test_dropout_matches_plain_cuda_for_a_seed).
CPU_RNG = pytest.mark.skipif(superchip.executor() != "cpu",
                             reason="random masks from CUDA's generator, not the CPU's")


@CPU_RNG
def test_dropout_seed_parity():
    x = torch.randn(64, 32)
    out_cpu, out_dev = _parity(nn.Dropout(p=0.3), x, seed=123)
    zeros = (out_dev.detach().cpu() == 0).float().mean().item()
    assert 0.2 < zeros < 0.4, zeros                      # it really dropped ~30%
    # Another seed gives another mask.
    torch.manual_seed(124)
    other = nn.functional.dropout(x.to(DEVICE), 0.3)
    assert not torch.equal(other.cpu() == 0, out_dev.detach().cpu() == 0)


@CPU_RNG
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_dropout_gives_the_cpus_bits_in_every_dtype(dtype, inplace):
    # Note [Dropout on the CPU executor]: ATen takes the fused native_dropout for a superchip
    # input and the composite for a CPU one; in bf16/fp16 the two round the scale differently,
    # and the gradient differed from the CPU's on about one element in ten.
    x = torch.randn(64, 64).to(dtype)
    g = torch.randn(64, 64).to(dtype)
    res = {}
    for dev in ("cpu", DEVICE):
        xd = x.to(dev).detach().requires_grad_()
        torch.manual_seed(3)
        y = F.dropout(xd * 1, 0.3, training=True, inplace=inplace)
        y.backward(g.to(dev))
        res[str(dev)] = (y.detach().cpu(), xd.grad.cpu())
    (yc, gc), (ys, gs) = res["cpu"], res[str(DEVICE)]
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(ys.view(bits), yc.view(bits)) and torch.equal(gs.view(bits), gc.view(bits))
    # and p = 0 / p = 1 as on the CPU
    xd = x.to(DEVICE)
    assert torch.equal(F.dropout(xd, 0.0).cpu(), x) and torch.equal(F.dropout(xd, 1.0).cpu(), F.dropout(x, 1.0))


@pytest.mark.skipif(superchip.executor() != "cuda", reason="needs the CUDA executor")
def test_dropout_matches_plain_cuda_for_a_seed():
    # Forward only on plain CUDA: its backward cannot run in a process with superchip loaded
    # with torch 2.11 (Note [CUDA reference in its own process], parity_train.py).
    x = torch.randn(64, 32)
    torch.manual_seed(123)
    ref = F.dropout(x.cuda(), 0.3).cpu()
    torch.manual_seed(123)
    xd = x.to(DEVICE).requires_grad_()
    out = F.dropout(xd, 0.3)
    assert torch.equal(out.detach().cpu(), ref)
    g = torch.randn_like(x)
    out.backward(g.to(DEVICE))
    kept = ref != 0  # x has no exact zeros
    assert 0.6 < kept.float().mean().item() < 0.8
    torch.testing.assert_close(xd.grad.cpu(), torch.where(kept, g / 0.7, torch.zeros_like(g)),
                               rtol=1e-6, atol=0.0)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        # Dropout's mask matches the CPU reference's only with the CPU executor (CPU_RNG).
        p = 0.1 if superchip.executor() == "cpu" else 0.0
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32),
                                 nn.Linear(32, 32), nn.ReLU(), nn.Dropout(p),
                                 nn.Linear(32, 3))

    def forward(self, x):
        return F.log_softmax(self.net(x), dim=-1)


def test_small_mlp_with_loss_and_sgd_step():
    torch.manual_seed(7)
    ref = _MLP()
    dev = copy.deepcopy(ref).to(DEVICE)
    x = torch.randn(10, 12)
    y = torch.randint(0, 3, (10,))
    opt_cpu = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_dev = torch.optim.SGD(dev.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(100 + step)
        loss_cpu = F.nll_loss(ref(x), y)
        torch.manual_seed(100 + step)
        loss_dev = F.nll_loss(dev(x.to(DEVICE)), y.to(DEVICE))
        assert_close_cpu(loss_dev, loss_cpu.detach())
        for opt, loss in ((opt_cpu, loss_cpu), (opt_dev, loss_dev)):
            opt.zero_grad()
            loss.backward()
        for (name, p_cpu), p_dev in zip(ref.named_parameters(), dev.parameters()):
            assert_close_cpu(p_dev.grad, p_cpu.grad, msg=f"step {step} grad {name}")
        opt_cpu.step()
        opt_dev.step()
    for p_cpu, p_dev in zip(ref.parameters(), dev.parameters()):
        assert_close_cpu(p_dev.detach(), p_cpu.detach())


def test_clip_grad_norm_and_no_grad():
    torch.manual_seed(8)
    ref = nn.Linear(8, 8)
    dev = copy.deepcopy(ref).to(DEVICE)
    x = torch.randn(4, 8) * 10
    ref(x).pow(2).sum().backward()
    dev(x.to(DEVICE)).pow(2).sum().backward()
    n_cpu = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    n_dev = torch.nn.utils.clip_grad_norm_(dev.parameters(), 1.0)
    assert n_dev.device == DEVICE
    assert_close_cpu(n_dev, n_cpu)
    for p_cpu, p_dev in zip(ref.parameters(), dev.parameters()):
        assert_close_cpu(p_dev.grad, p_cpu.grad)
    with torch.no_grad():
        out = dev(x.to(DEVICE))
    assert not out.requires_grad and out.grad_fn is None


# ---- composite ops with an executor kernel (Note [Forwarding composite kernels]) ----

class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


_COMPOSITE_CASES = {  # name: (function of x and a weight, shape of x, differentiable)
    # mish's backward: CPU and CUDA have a mish_backward kernel beside its decomposition.
    "mish": (lambda x, w: F.mish(x), (4096,), True),
    # F.rms_norm calls _fused_rms_norm: CUDA's fused kernel, a decomposition on the CPU.
    "rms_norm": (lambda x, w: F.rms_norm(x, (64,), w), (32, 64), True),
    # The CPU has a native_channel_shuffle kernel beside its decomposition (no derivative).
    "channel_shuffle": (lambda x, w: torch.ops.aten.native_channel_shuffle(x, 4), (2, 8, 3, 3), False),
}


@pytest.mark.parametrize("case", list(_COMPOSITE_CASES))
def test_composite_ops_run_the_executors_kernels(case):
    fn, shape, differentiable = _COMPOSITE_CASES[case]
    ref_device = superchip.executor()
    # Backward only on the CPU executor: plain-CUDA backward cannot run in a process with
    # superchip loaded with torch 2.11 (Note [CUDA reference in its own process]).
    backward = differentiable and ref_device == "cpu"
    torch.manual_seed(0)
    x, g, w = torch.randn(shape), torch.randn(shape), torch.linspace(0.5, 1.5, 64)

    def run(device):
        xd, gd, wd = x.to(device).requires_grad_(backward), g.to(device), w.to(device)
        names = _OpNames()
        with names:
            out = fn(xd, wd)
            grad = torch.autograd.grad(out, xd, gd)[0] if backward else None
        return names.names, out.detach().cpu(), grad.cpu() if backward else None

    ops_ref, out_ref, grad_ref = run(ref_device)
    ops, out, grad = run("superchip")
    assert ops == ops_ref, f"superchip ran {ops}, {ref_device} {ops_ref}"
    assert torch.equal(out, out_ref)
    if backward:
        assert torch.equal(grad, grad_ref)
