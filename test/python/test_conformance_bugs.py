"""Regressions found by running PyTorch's own device-generic tests on superchip (issue 9).

Each test failed before its fix: zero tensors (crash), out= tensors overlapping an input
(silent wrong result), in-place ops over one storage, the fused RNN cells, SDPA with a mask
that requires grad, conj_physical_ on a conjugate view, ldexp_ broadcasting into self,
mode(out=), copy-on-write storages (torch._lazy_clone), and quantized tensors (refused with a
clear error instead of a tensor that lost its quantizer).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

import superchip

from helpers import DEVICE, assert_close_cpu, run_python, to_device

OVERLAP = "refer to a single memory location"


# ---- zero tensors (torch._efficientzerotensor) ----

def _run_ok(code: str):
    proc = run_python(textwrap.dedent(code))
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc.stdout


def test_efficientzerotensor_reads_as_zeros():
    out = _run_ok("""
        import torch, superchip
        z = torch._efficientzerotensor((2, 3), device="superchip")
        assert z._is_zerotensor() and z.device.type == "superchip"
        assert torch.equal(z.cpu(), torch.zeros(2, 3))
        print(z)                                   # repr reads the values
        for view in (z.t(), z[1], z.unfold(1, 2, 1), z.view(3, 2), z.expand(4, 2, 3)):
            assert view._is_zerotensor(), view
            assert torch.equal(view.cpu(), torch.zeros(view.shape))
        assert torch.equal((z + 1).cpu(), torch.ones(2, 3))
        assert torch.equal(z.clone().cpu(), torch.zeros(2, 3)) and not z.clone()._is_zerotensor()
        assert z.sum().item() == 0.0
        zi = torch._efficientzerotensor((4,), dtype=torch.int64, device="superchip")
        assert zi.dtype == torch.int64 and zi.cpu().tolist() == [0, 0, 0, 0]
        print("OK")
    """)
    assert "OK" in out



def test_sparse_mm_with_amax_or_amin_reduce_backward_gives_the_cpus_gradients():
    # Note [Kernels that read requires_grad] (backend/native/Forward.cpp): the CPU kernel saves
    # the argmax only for operands that require grad; superchip's aliases did not, and the
    # backward read an empty index tensor: a segmentation fault (in a fresh process here).
    out = _run_ok("""
        import torch, superchip
        torch.manual_seed(0)
        d = torch.randn(6, 5)
        d[d < 0] = 0
        w = torch.randn(5, 3)
        for reduce in ("amax", "amin", "sum", "mean"):
            grads = {}
            for dev in ("cpu", "superchip"):
                a = d.to_sparse_csr().to(dev).requires_grad_()
                b = w.clone().to(dev).requires_grad_()  # a leaf on either device
                out = torch.sparse.mm(a, b, reduce)
                out.pow(2).sum().backward()
                grads[dev] = (out.detach().cpu(), a.grad.to_dense().cpu(), b.grad.cpu())
            for got, want in zip(grads["superchip"], grads["cpu"]):
                assert torch.equal(got, want) if superchip.executor() == "cpu" else torch.allclose(got, want), reduce
        print("OK")
    """)
    assert "OK" in out

def test_zero_tensor_owns_no_memory():
    out = _run_ok("""
        import torch, superchip
        before = superchip.memory_stats()
        z = torch._efficientzerotensor((1024, 1024), device="superchip")
        after = superchip.memory_stats()
        for key in ("hbm.allocated_bytes", "hbm.external_bytes", "hbm.active_allocations"):
            assert after[key] == before[key], (key, before[key], after[key])
        del z
        print("OK")
    """)
    assert "OK" in out


def test_sgn_backward_zero_grad_is_readable():
    out = _run_ok("""
        import torch, superchip
        x = torch.randn(5, device="superchip", requires_grad=True)
        torch.sgn(x).sum().backward()
        print(x.grad)
        assert torch.equal(x.grad.cpu(), torch.zeros(5))
        y = torch.randn(3, 4, device="superchip", requires_grad=True)
        (torch.sgn(y) * 2 + y).sum().backward()
        assert torch.equal(y.grad.cpu(), torch.ones(3, 4))
        print("OK")
    """)
    assert "OK" in out


# ---- out= overlapping an input: detected as on CPU ----

def _overlap_cases(device):
    """(name, callable) pairs whose out= overlaps an input; each raises on CPU."""
    a = torch.arange(10.0, device=device)
    idx = torch.tensor([0, 1, 2], device=device)
    li = torch.zeros(2, dtype=torch.long, device=device)
    return [
        ("gather", lambda: torch.gather(a, 0, idx, out=a[:3])),
        ("cat", lambda: torch.cat([a[:3], a[3:6]], out=a[2:8])),
        ("take", lambda: torch.take(a, idx, out=a[1:4])),
        ("masked_select", lambda: torch.masked_select(a[:6], a[:6] > 3, out=a[:6])),
        ("kthvalue", lambda: torch.kthvalue(a.view(2, 5), 2, 1, out=(a[:2], li))),
        ("add", lambda: torch.add(a[:5], 1, out=a[1:6])),
    ]


@pytest.mark.parametrize("name", ["gather", "cat", "take", "masked_select", "kthvalue", "add"])
def test_out_overlapping_input_raises_like_cpu(name):
    cpu_case = dict(_overlap_cases("cpu"))[name]
    with pytest.raises(RuntimeError, match=OVERLAP):
        cpu_case()
    case = dict(_overlap_cases(DEVICE))[name]
    with pytest.raises(RuntimeError, match=OVERLAP):
        case()


def test_in_place_and_views_of_one_storage_still_work():
    base = torch.randn(12)
    x = base.to(DEVICE)
    y = x.clone()
    y.add_(y)                                    # in-place, the operand is self
    assert_close_cpu(y, base * 2)
    z = x.clone()
    torch.add(z, z, out=z)                       # out= is the very input
    assert_close_cpu(z, base * 2)
    w = x.clone().view(3, 4)
    w[0].mul_(w[1])                              # views of one storage, in and out disjoint
    ref = base.clone().view(3, 4)
    ref[0].mul_(ref[1])
    assert_close_cpu(w, ref)
    v = x.clone()
    torch.mul(v[:6], v[6:], out=v[6:])           # out= fully equal to an input: allowed
    ref = base.clone()
    torch.mul(ref[:6], ref[6:], out=ref[6:])
    assert_close_cpu(v, ref)


def test_ldexp_inplace_does_not_resize_self():
    for device in ("cpu", DEVICE):
        a = torch.ones(3, device=device)
        b = torch.ones(2, 3, dtype=torch.int64, device=device)
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
            a.ldexp_(b)
        assert a.shape == (3,)


def test_out_resize_is_adopted(clean_memory):
    a = torch.randn(4, 5)
    out = torch.empty(0, device=DEVICE)
    torch.add(a.to(DEVICE), 1, out=out)
    assert_close_cpu(out, a + 1)
    sel = torch.empty(0, device=DEVICE)
    torch.masked_select(a.to(DEVICE), a.to(DEVICE) > 0, out=sel)
    assert_close_cpu(sel, torch.masked_select(a, a > 0))
    # a resized out= that is also read (same storage as an input) keeps CPU's result
    x = torch.arange(4.0)
    xs = x.to(DEVICE)
    torch.cat([xs, xs], out=torch.empty(0, device=DEVICE))
    assert_close_cpu(xs, x)


# ---- RNNs (fused cells) ----

@pytest.mark.parametrize("cls", [torch.nn.GRU, torch.nn.LSTM, torch.nn.GRUCell,
                                 torch.nn.LSTMCell])
@pytest.mark.parametrize("bias", [True, False])
def test_rnn_forward_backward_like_cpu(cls, bias):
    torch.manual_seed(0)
    cell = cls.__name__.endswith("Cell")
    kwargs = {} if cell else {"num_layers": 2, "batch_first": True}
    ref = cls(4, 6, bias=bias, **kwargs)
    mod = cls(4, 6, bias=bias, **kwargs).to(DEVICE)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4) if cell else torch.randn(3, 5, 4)
    xr = x.clone().requires_grad_()
    xs = x.to(DEVICE).requires_grad_()
    out_r, out_s = ref(xr), mod(xs)
    flat_r = out_r if isinstance(out_r, tuple) else (out_r,)
    flat_s = out_s if isinstance(out_s, tuple) else (out_s,)
    loss_r = sum(t.sum() if isinstance(t, torch.Tensor) else sum(u.sum() for u in t) for t in flat_r)
    loss_s = sum(t.sum() if isinstance(t, torch.Tensor) else sum(u.sum() for u in t) for t in flat_s)
    loss_r.backward()
    loss_s.backward()
    kw = {"rtol": 1e-5, "atol": 1e-5}  # fused cell vs CPU cell: same math, other op order
    assert_close_cpu(to_device(flat_s[0], DEVICE), flat_r[0], **kw)
    assert_close_cpu(xs.grad, xr.grad, **kw)
    for (name, p), q in zip(ref.named_parameters(), mod.parameters()):
        assert_close_cpu(q.grad, p.grad, **kw)


def test_fused_cells_match_cuda_layout():
    torch.manual_seed(0)
    n, h = 3, 5
    ig, hg = torch.randn(n, 4 * h, device=DEVICE), torch.randn(n, 4 * h, device=DEVICE)
    cx = torch.randn(n, h, device=DEVICE)
    hy, cy, ws = torch.ops.aten._thnn_fused_lstm_cell(ig, hg, cx)
    assert hy.shape == cy.shape == (n, h) and ws.shape == (n, 4 * h)
    gates = (ig + hg).cpu().chunk(4, 1)
    c_ref = gates[1].sigmoid() * cx.cpu() + gates[0].sigmoid() * gates[2].tanh()
    assert_close_cpu(cy, c_ref)
    assert_close_cpu(hy, gates[3].sigmoid() * c_ref.tanh())
    ig3, hg3 = torch.randn(n, 3 * h, device=DEVICE), torch.randn(n, 3 * h, device=DEVICE)
    hy, ws = torch.ops.aten._thnn_fused_gru_cell(ig3, hg3, cx)
    assert hy.shape == (n, h) and ws.shape == (n, 5 * h)
    # Our cell's text on the CPU executor; CUDA's own kernel says "... (while checking
    # arguments for _thnn_fused_gru_cell)" on the CUDA executor.
    with pytest.raises(RuntimeError, match="_thnn_fused_gru_cell"):
        torch.ops.aten._thnn_fused_gru_cell(ig3, hg3, torch.randn(n, h + 1, device=DEVICE))


# ---- scaled_dot_product_attention with a mask that requires grad ----

def test_sdpa_float_mask_requires_grad_like_cpu():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    mask = torch.randn(2, 3, 5, 5)

    def run(device):
        ts = [t.clone().to(device).requires_grad_() for t in (q, k, v, mask)]
        out = F.scaled_dot_product_attention(*ts[:3], attn_mask=ts[3])
        out.sum().backward()
        return out, [t.grad for t in ts]

    out_c, grads_c = run("cpu")
    out_s, grads_s = run(DEVICE)
    assert_close_cpu(out_s, out_c.detach())
    for gs, gc in zip(grads_s, grads_c):
        assert_close_cpu(gs, gc)


# ---- conj_physical_, mode(out=) ----

def test_conj_physical_inplace_on_conjugate_view():
    for make in (lambda t: t.conj(), lambda t: t):
        base = torch.tensor([1 + 2j, 3 - 1j, -2j])
        ref = make(base.clone())
        ref.conj_physical_()
        x = make(base.to(DEVICE))
        x.conj_physical_()
        assert x.is_conj() == ref.is_conj()
        assert_close_cpu(x.resolve_conj(), ref.resolve_conj())


def test_mode_out():
    x = torch.tensor([[1.0, 2, 2], [3, 3, 1]])
    ref = torch.mode(x, 1)
    values = torch.empty(0, device=DEVICE)
    indices = torch.empty(0, dtype=torch.long, device=DEVICE)
    torch.mode(x.to(DEVICE), 1, out=(values, indices))
    assert_close_cpu(values, ref.values)
    assert_close_cpu(indices, ref.indices)


@pytest.mark.parametrize("shape,groups", [((2, 6, 5, 7), 3), ((3, 8, 4, 4, 3), 4), ((2, 4, 3, 3), 2)])
def test_group_norm_channels_last_gradients_like_cpu(shape, groups):
    # Note [GroupNorm layouts]: torch's formula gives a non-CPU backward plain-format operands;
    # the CPU executor must still see CPU's channels-last ones (bitwise gradients, same strides).
    torch.manual_seed(len(shape))
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = torch.randn(shape).to(memory_format=fmt)
    ref = torch.nn.GroupNorm(groups, shape[1])
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    mod = torch.nn.GroupNorm(groups, shape[1]).to(DEVICE)
    mod.load_state_dict(ref.state_dict())
    xc = x.clone().requires_grad_()
    xs = x.to(DEVICE).requires_grad_()
    yc, ys = ref(xc), mod(xs)
    g = torch.randn_like(yc)
    yc.backward(g)
    ys.backward(g.to(DEVICE))
    for got, want in ((ys, yc), (xs.grad, xc.grad), (mod.weight.grad, ref.weight.grad),
                      (mod.bias.grad, ref.bias.grad)):
        assert got.stride() == want.stride()
        assert torch.equal(got.cpu(), want), (got.cpu() - want).abs().max()
    # A plain-format input in the same process still takes the plain path.
    xp = torch.randn(shape)
    xpc, xps = xp.clone().requires_grad_(), xp.to(DEVICE).requires_grad_()
    ref(xpc).sum().backward()
    mod(xps).sum().backward()
    assert torch.equal(xps.grad.cpu(), xpc.grad)
    # Double backward (create_graph) takes torch's differentiable formula on both devices.
    xc2, xs2 = x.clone().requires_grad_(), x.to(DEVICE).requires_grad_()
    (gc,) = torch.autograd.grad((ref(xc2) * g).sum(), xc2, create_graph=True)
    (gs,) = torch.autograd.grad((mod(xs2) * g.to(DEVICE)).sum(), xs2, create_graph=True)
    torch.testing.assert_close(gs.cpu(), gc, rtol=1e-5, atol=1e-6)


# ---- copy-on-write (torch._lazy_clone) ----

def test_lazy_clone_reads_do_not_materialize():
    a = torch.arange(6.0, device=DEVICE)
    b = torch._lazy_clone(a)
    assert torch._C._is_cow_tensor(a) and torch._C._is_cow_tensor(b)
    c = a + b                                    # reads both
    assert a.sum().item() == 15.0                # reads through _local_scalar_dense
    assert torch._C._is_cow_tensor(a) and torch._C._is_cow_tensor(b)
    assert_close_cpu(c, torch.arange(6.0) * 2)
    b.mul_(2)                                    # a write materializes only b
    assert not torch._C._is_cow_tensor(b)
    assert_close_cpu(a, torch.arange(6.0))
    assert_close_cpu(b, torch.arange(6.0) * 2)
    a.add_(1)                                    # the last reference: written in place
    assert_close_cpu(a, torch.arange(6.0) + 1)


def test_lazy_clone_of_forwarded_output(clean_memory):
    before = superchip.memory_stats()["hbm.external_bytes"]
    c = torch.arange(6.0, device=DEVICE) * 3     # adopted executor output
    d = torch._lazy_clone(c)
    c.add_(1)
    assert_close_cpu(c, torch.arange(6.0) * 3 + 1)
    assert_close_cpu(d, torch.arange(6.0) * 3)
    e = torch._lazy_clone(d)
    del d
    e.sub_(1)                                    # steals the bytes: last reference
    assert_close_cpu(e, torch.arange(6.0) * 3 - 1)
    assert superchip.tier_of(e) == "hbm"
    del c, e
    assert superchip.memory_stats()["hbm.external_bytes"] == before


def test_lazy_clone_keeps_host_tier():
    x = torch.randn(64, device=DEVICE)
    superchip.move_to_tier(x, "host")
    y = torch._lazy_clone(x)
    assert superchip.tier_of(x) == "host" and superchip.tier_of(y) == "host"
    assert_close_cpu(y, x.cpu())


# ---- quantized tensors (Note [Quantized tensors]; found by test_view_ops.py's flatten/ravel) ----

@pytest.mark.filterwarnings("ignore:.*quantize.*deprecated")
@pytest.mark.parametrize("make", [
    lambda x: torch.quantize_per_tensor(x.to(DEVICE), 0.1, 0, torch.qint8),
    lambda x: torch.quantize_per_channel(x.to(DEVICE), torch.full((4,), 0.1, device=DEVICE),
                                         torch.zeros(4, dtype=torch.long, device=DEVICE), 0, torch.quint8),
    lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.qint8).to(DEVICE),
    lambda x: torch._empty_affine_quantized([4, 3], device=DEVICE, dtype=torch.qint8),
], ids=["quantize_per_tensor", "quantize_per_channel", "to_superchip", "empty_affine_quantized"])
def test_quantized_tensors_are_refused_with_a_clear_error(make, clean_memory):
    # Before: quantize_per_tensor returned a qint8 tensor without its quantizer (is_quantized
    # False; dequantize, .cpu() and printing failed with unrelated errors) and .to("superchip")
    # of a CPU quantized tensor found no kernel.
    x = torch.randn(4, 3)
    start = superchip.memory_stats()["hbm.requested_bytes"]
    with pytest.raises(RuntimeError, match="does not hold PyTorch's quantized tensors.*Quantize on the cpu"):
        make(x)
    assert superchip.memory_stats()["hbm.requested_bytes"] == start
    # Quantizing on the cpu still works with superchip imported.
    q = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
    assert q.is_quantized and torch.equal(q.dequantize(), torch.round(x / 0.1).clamp(-128, 127) * 0.1)


# ---- Note [Integer histc] ----

def _histc_like_cuda(x: torch.Tensor, bins: int, lo, hi) -> torch.Tensor:
    """CUDA's histc of an integer tensor, element by element in Python integers."""
    info = torch.iinfo(x.dtype)
    wrap = lambda v: (int(v) - info.min) % (info.max - info.min + 1) + info.min  # noqa: E731
    mn, mx = wrap(int(lo)), wrap(int(hi))
    vals = [int(v) for v in x.reshape(-1).tolist()]
    if int(lo) == int(hi) and vals:
        mn, mx = min(vals), max(vals)
    if mn == mx:
        mn, mx = wrap(mn - 1), wrap(mx + 1)
    counts = [0] * bins
    for v in vals:
        if mn <= v <= mx:
            counts[min(bins - 1, (v - mn) * bins // (mx - mn))] += 1
    return torch.tensor(counts, dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_integer_histc_counts_as_cuda_does(dtype):
    """transformers' grouped_mm MoE (every HF MoE's default) counts tokens per expert with an
    int32 histc off the CPU; CPU's kernel refuses integers ("histogram_cpu not implemented
    for 'Int'"), CUDA's counts them. The emulated superchip gives CUDA's counts."""
    if superchip.executor() == "cuda":
        pytest.skip("CUDA's own histc runs with the CUDA executor")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 100, (7, 11), generator=g).to(dtype)
    for bins, lo, hi in ((8, 0, 99), (5, 10, 60), (8, 0, 0), (3, 0.5, 40.7), (4, 7, 7), (100, 0, 99)):
        got = torch.histc(x.to("superchip"), bins=bins, min=lo, max=hi)
        assert got.device == DEVICE and got.dtype == dtype
        assert torch.equal(got.cpu(), _histc_like_cuda(x, bins, lo, hi)), (bins, lo, hi)
        out = torch.empty(0, dtype=dtype, device="superchip")
        torch.histc(x.to("superchip"), bins=bins, min=lo, max=hi, out=out)
        assert torch.equal(out.cpu(), got.cpu())
    const = torch.full((5,), 3, dtype=dtype)
    assert torch.equal(torch.histc(const.to("superchip"), bins=4).cpu(), _histc_like_cuda(const, 4, 0, 0))
    empty = torch.empty(0, dtype=dtype, device="superchip")
    if dtype == torch.uint8:  # [0 - 1, 0 + 1] wraps to [255, 1]: CUDA refuses it too
        with pytest.raises(RuntimeError, match="max must be larger than min"):
            torch.histc(empty, bins=3)
    else:
        assert torch.equal(torch.histc(empty, bins=3).cpu(), torch.zeros(3, dtype=dtype))
    # Floating inputs still run CPU's kernel: its bits.
    f = torch.randn(100, generator=g)
    assert torch.equal(torch.histc(f.to("superchip"), bins=7, min=-1, max=1).cpu(), torch.histc(f, 7, -1, 1))
    with pytest.raises(RuntimeError, match="bins must be > 0"):
        torch.histc(x.to("superchip"), bins=0)


def test_hf_moe_default_experts_train_like_cpu():
    """A tiny Mixtral with transformers' default experts implementation (grouped_mm, which
    calls an int32 histc on any device but "cpu" and "mps") trains on superchip with CPU's bits."""
    transformers = pytest.importorskip("transformers")
    if superchip.executor() == "cuda":
        pytest.skip("compared with the CPU's bits: the emulated superchip's case")
    import copy

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)
    ref = transformers.MixtralForCausalLM(cfg)
    model = copy.deepcopy(ref).to("superchip")
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 128, (2, 8), generator=g)
        loss_ref = ref(input_ids=x, labels=x).loss
        loss_ref.backward(); o_ref.step(); o_ref.zero_grad()
        loss = model(input_ids=x.to("superchip"), labels=x.to("superchip")).loss
        loss.backward(); opt.step(); opt.zero_grad()
        assert loss.item() == loss_ref.item()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b.cpu()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kaiser_window_as_on_cpu(dtype):
    # Found by PyTorch's test_tensor_creation_ops: kaiser_window's composite makes the window
    # with a DispatchStub of the output's device, which superchip lacked: "INTERNAL ASSERT
    # FAILED ... DispatchStub: missing kernel for superchip" (asking the user to report a
    # PyTorch bug). Every overload, and the out= ones, now gives the CPU's bits.
    calls = [lambda d: torch.kaiser_window(10, dtype=dtype, device=d),
             lambda d: torch.kaiser_window(7, periodic=False, dtype=dtype, device=d),
             lambda d: torch.kaiser_window(12, True, 5.5, dtype=dtype, device=d),
             lambda d: torch.kaiser_window(1, dtype=dtype, device=d),
             lambda d: torch.kaiser_window(0, dtype=dtype, device=d),
             lambda d: torch.ops.aten.kaiser_window.out(9, out=torch.empty(0, dtype=dtype, device=d)),
             lambda d: torch.ops.aten.kaiser_window.periodic_out(9, False, out=torch.empty(0, dtype=dtype, device=d)),
             lambda d: torch.ops.aten.kaiser_window.beta_out(9, True, 3.0, out=torch.empty(0, dtype=dtype, device=d))]
    for call in calls:
        want, got = call("cpu"), call(DEVICE)
        assert got.device.type == "superchip" and got.dtype == want.dtype
        assert torch.equal(got.cpu(), want)


def test_index_put_refuses_a_cpu_values_tensor_as_cuda_does():
    # Found by PyTorch's test_indexing (test_invalid_device): CPU indices are accepted (as on
    # CUDA), and a CPU values tensor was too, written into the superchip tensor, where CUDA
    # raises. CPU 0-dim values stay accepted, as scalars.
    b = torch.zeros(5, device=DEVICE)
    idx = torch.tensor([0, 1])
    for accumulate in (False, True):
        with pytest.raises(RuntimeError, match="same device"):
            torch.index_put_(b, (idx,), torch.tensor([1.0, 2.0]), accumulate=accumulate)
        assert torch.equal(b.cpu(), torch.zeros(5))
    with pytest.raises(RuntimeError, match="same device"):
        b[idx] = torch.tensor([1.0, 2.0])
    # One CPU value through one bool mask on the device, not accumulated: ATen's masked_fill_
    # path, which CUDA takes whatever the value's dims (found by review).
    mask = torch.tensor([False, False, True, False, False], device=DEVICE)
    b.index_put_((mask,), torch.tensor([6.0]))
    torch.index_put_(b, (mask,), torch.tensor([[7.0]]))
    assert b.cpu().tolist() == [0.0, 0.0, 7.0, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="same device"):  # accumulated: CUDA refuses it
        b.index_put_((mask,), torch.tensor([1.0]), accumulate=True)
    b[2] = 0.0
    b[idx] = torch.tensor(3.0)  # a CPU 0-dim value: a scalar
    b.index_put_((idx,), torch.tensor([1.0, 2.0], device=DEVICE), accumulate=True)
    assert b.cpu().tolist() == [4.0, 5.0, 0.0, 0.0, 0.0]
    assert b[idx].cpu().tolist() == [4.0, 5.0]  # CPU indices read as before


# ---- Note [Norm statistics]: the statistics batch and layer norm save for their backward ----

def _norm_cases(dev):
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    aten = torch.ops.aten
    bf, fp = torch.bfloat16, torch.float16
    return {
        "batch_norm eval": (aten._native_batch_norm_legit.default,
                            (r(2, 3, 4), r(3), r(3), r(3), r(3).abs() + 1, False, 0.1, 1e-5)),
        "batch_norm train bf16": (aten.native_batch_norm.default,
                                  (r(4, 3, 5, dtype=bf), r(3, dtype=bf), r(3, dtype=bf), r(3, dtype=bf),
                                   r(3, dtype=bf).abs() + 1, True, 0.1, 1e-5)),
        "batch_norm_with_update fp16": (aten._batch_norm_with_update.default,
                                        (r(4, 3, 5, dtype=fp), r(3, dtype=fp), r(3, dtype=fp), r(3, dtype=fp),
                                         r(3, dtype=fp).abs() + 1, 0.1, 1e-5)),
        "layer_norm bf16": (aten.native_layer_norm.default,
                            (r(2, 3, 4, dtype=bf), [4], r(4, dtype=bf), r(4, dtype=bf), 1e-5)),
    }


def test_norm_statistics_have_the_shapes_and_dtypes_fake_tensors_predict():
    # The CPU executor's kernels saved them by CPU's rules (empty in eval mode, bf16/fp16 for
    # bf16/fp16 inputs), where FakeTensor and torch._decomp give every device but the CPU
    # CUDA's ([C], float32): a compiled or exported trace predicted other outputs than eager
    # gave (found by PyTorch's test_decomp on superchip).
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, (op, args) in _norm_cases(DEVICE).items():
        eager = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        assert [(t.shape, t.dtype) for t in eager] == [(t.shape, t.dtype) for t in fake], name
        for e, c in zip(eager[:1], op(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])[:1]):
            assert torch.equal(e.cpu(), c), name  # the normalised output is CPU's bits


def test_fake_tensors_predict_the_layouts_eager_gives():
    # Fake-tensor rules that choose a layout by device_hint() took the non-CPU side for
    # superchip, where the CPU executor's kernels give CPU's layouts (Note [Why superchip patches
    # Inductor], point 10; found by running Inductor's own tests on superchip).
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(0)
    w, idx, off = torch.randn(10, 3, generator=gen), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    cases = {
        "nonzero_static": (lambda x: (torch.nonzero_static(x, size=8),), [torch.eye(8)]),
        "pixel_shuffle channels_last": (lambda x: (F.pixel_shuffle(x, 2),),
                                        [torch.randn(1, 8, 4, 4, generator=gen).to(memory_format=torch.channels_last)]),
        "_embedding_bag": (lambda w, i, o: torch.ops.aten._embedding_bag(w, i, o, False, 1), [w, idx, off]),
        # include_last_offset: compiled EmbeddingBag failed its size check (Inductor's OpInfo test)
        "_embedding_bag include_last_offset": (
            lambda w, i, o: torch.ops.aten._embedding_bag(w, i, o, False, 0, False, None, True),
            [w, idx, torch.tensor([0, 4, 8])]),
    }
    for name, (f, args) in cases.items():
        args = [a.to(DEVICE) for a in args]
        eager = f(*args)
        with FakeTensorMode() as mode:
            fake = f(*[mode.from_tensor(a) for a in args])
        assert [(t.shape, t.stride(), t.dtype) for t in eager] == [(t.shape, t.stride(), t.dtype) for t in fake], name


@pytest.mark.parametrize("module", ["batch_norm", "instance_norm", "layer_norm"])
@pytest.mark.parametrize("dtype,params", [(torch.bfloat16, "same"), (torch.float16, "float"), (torch.float32, "same")])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_norm_gradients_stay_cpus_bits(module, dtype, params, mode):
    # The backward gives CPU's kernels their rules back (Note [Norm statistics]).
    make = {"batch_norm": lambda: torch.nn.BatchNorm2d(4), "instance_norm": lambda: torch.nn.InstanceNorm2d(4, affine=True),
            "layer_norm": lambda: torch.nn.LayerNorm([6, 5])}[module]
    import copy

    torch.manual_seed(0)
    base = make()
    base.train()
    base(torch.randn(3, 4, 6, 5))  # running statistics that are not the initial ones
    out = []
    for dev in ("cpu", DEVICE):
        m = copy.deepcopy(base).to(dev)
        m = m.to(dtype) if params == "same" else m
        getattr(m, mode)()
        x = torch.randn(3, 4, 6, 5, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev).requires_grad_()
        y = m(x)
        y.float().square().sum().backward()
        out.append([y.detach().cpu(), x.grad.cpu()] + [p.grad.cpu() for p in m.parameters()] + [b.cpu() for b in m.buffers()])
    assert all(torch.equal(a, b) for a, b in zip(*out))
