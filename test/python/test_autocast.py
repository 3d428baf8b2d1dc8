"""``torch.amp.autocast("superchip")`` follows CUDA's autocast policy lists: lower-precision
ops (matmul, linear, conv, bmm, baddbmm...) run in the autocast dtype, fp32 ops (softmax,
log_softmax, layer_norm, losses, exp/log/pow...) run in float32, and backward works."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import superchip  # noqa: F401

from helpers import DEVICE
from tolerances import tol

AMP_DTYPES = [torch.bfloat16, torch.float16]


def test_amp_supported_dtypes():
    supported = torch.superchip.get_amp_supported_dtype()
    assert torch.bfloat16 in supported and torch.float16 in supported
    assert torch.amp.is_autocast_available("superchip")


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_lower_precision_ops(dtype):
    a = torch.randn(8, 16, device=DEVICE)
    b = torch.randn(16, 4, device=DEVICE)
    lin = nn.Linear(16, 4).to(DEVICE)
    with torch.amp.autocast("superchip", dtype=dtype):
        assert torch.is_autocast_enabled("superchip")
        assert torch.get_autocast_dtype("superchip") == dtype
        mm = a @ b
        out = lin(a)
        bmm = torch.bmm(a.view(2, 4, 16), b.expand(2, 16, 4))
        addmm = torch.addmm(torch.zeros(4, device=DEVICE), a, b)
    assert mm.dtype == dtype and out.dtype == dtype and bmm.dtype == dtype
    assert addmm.dtype == dtype
    assert lin.weight.dtype == torch.float32  # parameters are not cast in place
    ref = (a.cpu().to(dtype) @ b.cpu().to(dtype))
    torch.testing.assert_close(mm.cpu(), ref, **tol(dtype))
    assert not torch.is_autocast_enabled("superchip")
    assert (a @ b).dtype == torch.float32


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_fp32_ops_stay_fp32(dtype):
    x = torch.randn(4, 10, device=DEVICE)
    h = x.to(dtype)  # a low-precision activation, as produced by a linear layer
    target = torch.randint(0, 10, (4,), device=DEVICE)
    with torch.amp.autocast("superchip", dtype=dtype):
        outs = {
            "softmax": torch.softmax(h, -1),
            "log_softmax": F.log_softmax(h, -1),
            "layer_norm": F.layer_norm(h, (10,)),
            "cross_entropy": F.cross_entropy(h, target),
            "exp": torch.exp(h),
            "sum": torch.sum(h),
            "mse_loss": F.mse_loss(h, x),
        }
    for name, out in outs.items():
        assert out.dtype == torch.float32, f"{name} gave {out.dtype}"
        assert out.device == DEVICE
    torch.testing.assert_close(outs["softmax"].cpu(), torch.softmax(h.cpu().float(), -1))


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_promote_ops(dtype):
    a = torch.randn(3, device=DEVICE)
    b = torch.randn(3, device=DEVICE).to(dtype)
    with torch.amp.autocast("superchip", dtype=dtype):
        assert torch.cat([a, b]).dtype == torch.float32   # widest input type
        assert torch.stack([a, b]).dtype == torch.float32
        assert torch.addcmul(a, b, b).dtype == torch.float32


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_binary_cross_entropy_is_banned_as_on_cuda(dtype):
    # CUDA's policy refuses F.binary_cross_entropy / nn.BCELoss under autocast (torch registers
    # that ban for CUDA alone); without it a float32 target failed with "Found dtype Float but
    # expected Half" and a low-precision one gave a half-precision loss without a word.
    p = torch.rand(8, device=DEVICE)
    with torch.amp.autocast("superchip", dtype=dtype):
        probs = torch.sigmoid(p @ torch.ones(8, 8, device=DEVICE))
        for target in (torch.rand(8, device=DEVICE), torch.rand(8, device=DEVICE).to(dtype)):
            with pytest.raises(RuntimeError, match="unsafe to autocast.*binary_cross_entropy_with_logits"):
                F.binary_cross_entropy(probs, target)
            with pytest.raises(RuntimeError, match="unsafe to autocast"):
                torch.nn.BCELoss()(probs, target)
        # What the message advises runs, in float32.
        logits = p @ torch.ones(8, 8, device=DEVICE)
        loss = F.binary_cross_entropy_with_logits(logits, torch.rand(8, device=DEVICE))
        assert loss.dtype == torch.float32
    # Outside autocast it is the CPU's loss.
    t = torch.rand(8)
    assert torch.equal(F.binary_cross_entropy(p.sigmoid(), t.to(DEVICE)).cpu(),
                       F.binary_cross_entropy(p.cpu().sigmoid(), t))


def test_disabled_and_nested_autocast():
    a = torch.randn(4, 4, device=DEVICE)
    with torch.amp.autocast("superchip", dtype=torch.bfloat16):
        with torch.amp.autocast("superchip", enabled=False):
            assert (a @ a).dtype == torch.float32
        assert (a @ a).dtype == torch.bfloat16
    with torch.autocast(device_type="superchip", dtype=torch.float16):
        assert (a @ a).dtype == torch.float16


def test_cpu_autocast_does_not_affect_superchip():
    a = torch.randn(4, 4, device=DEVICE)
    with torch.amp.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.float32


@pytest.mark.parametrize("dtype", AMP_DTYPES)
def test_backward_under_autocast(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))
    ref = [p.detach().clone() for p in model.parameters()]
    model = model.to(DEVICE)
    x = torch.randn(5, 8, device=DEVICE)
    y = torch.randint(0, 3, (5,), device=DEVICE)
    with torch.amp.autocast("superchip", dtype=dtype):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    assert logits.dtype == dtype and loss.dtype == torch.float32
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert p.grad.device == DEVICE
        assert torch.isfinite(p.grad.cpu()).all()
        assert p.grad.abs().sum().item() > 0

    # Same model, same input on CPU with CPU autocast: gradients agree to bf16/fp16 precision.
    cpu_model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        for p, r in zip(cpu_model.parameters(), ref):
            p.copy_(r)
    with torch.amp.autocast("cpu", dtype=dtype):
        loss_cpu = F.cross_entropy(cpu_model(x.cpu()), y.cpu())
    loss_cpu.backward()
    torch.testing.assert_close(loss.cpu(), loss_cpu, rtol=2e-2, atol=2e-2)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=5e-2, atol=5e-2)


def test_grad_scaler_on_superchip():
    model = nn.Linear(4, 2).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("superchip", init_scale=1024.0)
    before = model.weight.detach().cpu().clone()
    with torch.amp.autocast("superchip", dtype=torch.float16):
        loss = model(torch.randn(3, 4, device=DEVICE)).float().pow(2).mean()
    scaler.scale(loss).backward()
    assert model.weight.grad.abs().max().item() > 0
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.weight.detach().cpu(), before)
    assert scaler.get_scale() == 1024.0


def _amp_function(declare_fwd, declare_bwd):
    """An autograd function whose forward and backward are decorated as a library does,
    recording the dtypes its ops see."""

    class Mm(torch.autograd.Function):
        seen = []

        @staticmethod
        @declare_fwd
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            y = x @ w
            Mm.seen.append((x.dtype, y.dtype))
            return y

        @staticmethod
        @declare_bwd
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            gx = g @ w.t()  # a bf16 gradient and a float32 weight: needs the forward's autocast
            Mm.seen.append((g.dtype, gx.dtype))
            return gx, x.t() @ g

    return Mm


@pytest.mark.parametrize("cast_inputs", [None, torch.float32], ids=["autocast-state", "cast-fp32"])
@pytest.mark.parametrize("style", ["decorator", "partial", "cuda.amp"])
def test_functions_declared_for_cudas_autocast_keep_their_contract(style, cast_inputs):
    """Note [custom_fwd declared for cuda] (superchip/_amp.py): Liger, Unsloth and axolotl
    declare their autograd functions for CUDA's autocast; under torch.autocast("superchip")
    they must do what they do under CUDA's. The reference: the same function declared for
    "cpu", run on the CPU under CPU's autocast (matmul lowers precision under both policies).
    Before, cast_inputs was ignored (a bf16 forward) and the backward ran without autocast
    ("expected m1 and m2 to have the same dtype")."""
    import functools
    import warnings

    def declared(device_type):
        if style == "decorator":
            return (torch.amp.custom_fwd(device_type=device_type, cast_inputs=cast_inputs),
                    torch.amp.custom_bwd(device_type=device_type))
        if style == "partial":  # Liger's amp_custom_fwd
            fwd = functools.partial(torch.amp.custom_fwd, device_type=device_type)
            bwd = functools.partial(torch.amp.custom_bwd, device_type=device_type)
            return fwd(cast_inputs=cast_inputs), bwd
        if device_type == "cpu":
            return declared_cpu_for_cuda_amp
        return torch.cuda.amp.custom_fwd(cast_inputs=cast_inputs), torch.cuda.amp.custom_bwd

    declared_cpu_for_cuda_amp = (torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs),
                                 torch.amp.custom_bwd(device_type="cpu"))
    torch.manual_seed(0)
    x0, w0 = torch.randn(8, 16), torch.randn(16, 4)
    results = {}
    for device, declared_for in (("cpu", "cpu"), (DEVICE, "cuda")):
        with warnings.catch_warnings():  # torch.cuda.amp's are deprecated in favour of torch.amp's
            warnings.simplefilter("ignore", FutureWarning)
            fn = _amp_function(*declared(declared_for))
        x = x0.clone().to(device).requires_grad_()
        w = w0.clone().to(device).requires_grad_()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            y = fn.apply(x, w)
        y.float().square().sum().backward()
        results[declared_for] = (fn.seen, y.cpu(), x.grad.cpu(), w.grad.cpu())
    (seen_cpu, *cpu), (seen_superchip, *ours) = results["cpu"], results["cuda"]
    assert seen_superchip == seen_cpu
    assert seen_cpu[0][1] == (torch.float32 if cast_inputs else torch.bfloat16)
    for a, b in zip(cpu, ours):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("other", ["cuda", "cpu"])
def test_another_devices_autocast_says_it_does_not_cast_superchip(other):
    # Note [Another device's autocast] (backend/native/Forward.cpp): a script moved to superchip
    # that kept torch.autocast("cuda") trained in float32 without a word. It still does (torch's
    # per-device semantics), and the first superchip operator under it says so, once. CUDA's
    # autocast is switched on by its flag: torch.autocast("cuda") refuses without a GPU.
    import json
    import textwrap

    from helpers import run_python

    r = run_python(textwrap.dedent(f"""
        import json, warnings, torch, superchip
        x = torch.randn(4, 4, device="superchip")
        def caught(fn):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                out = fn()
            return out.dtype, [str(m.message) for m in w if "superchip:" in str(m.message)]
        def own():
            with torch.autocast("superchip", dtype=torch.bfloat16):
                return x @ x
        def other():
            torch.set_autocast_enabled("{other}", True)
            try:
                return x @ x
            finally:
                torch.set_autocast_enabled("{other}", False)
        res = dict(plain=caught(lambda: x @ x), own=caught(own), other=caught(other), again=caught(other))
        print(json.dumps({{k: [str(d), m] for k, (d, m) in res.items()}}))
    """))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["plain"] == ["torch.float32", []] and out["own"] == ["torch.bfloat16", []], out
    dtype, said = out["other"]
    assert dtype == "torch.float32" and len(said) == 1, out  # nothing cast, as torch does
    assert f'torch.autocast("{other}") is on' in said[0] and 'torch.autocast("superchip"' in said[0], said
    assert out["again"] == ["torch.float32", []], out  # once per process
