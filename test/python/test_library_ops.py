"""Operators other libraries define with torch.library (python/superchip/_library.py, Note
[Other libraries' operators]): where an operator has a kernel for the executor's device and a
"default" (composite) one, superchip tensors run the executor's kernel, as the executor's own
tensors do, whenever the operator was registered. Before, the default ran on superchip: other
bits than the executor (bitsandbytes' 32-bit AdamW) and, on the CUDA executor, a pure-torch
fallback in place of a library's CUDA kernel.

Each operator's kernels return different values per device, so the test sees which one ran:
the executor's ("cpu" or "cuda") is the one expected.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import superchip

from helpers import run_python

EXECUTOR = superchip.executor()
ADDS = {"cpu": 1.0, "cuda": 3.0, "default": 2.0}  # what each kernel adds


def _superchip(x):
    return x.to("superchip")


def test_a_custom_ops_executor_kernel_outranks_its_default():
    @torch.library.custom_op("sc_libops::add_c", mutates_args=())
    def add_c(x: torch.Tensor) -> torch.Tensor:
        return x + ADDS["default"]

    for device in ("cpu", "cuda"):
        add_c.register_kernel(device)(lambda x, d=device: x + ADDS[d])

    x = torch.arange(4.0)
    assert torch.equal(add_c(x), x + ADDS["cpu"])  # plain CPU unchanged
    assert torch.equal(add_c(_superchip(x)).cpu(), x + ADDS[EXECUTOR])


@pytest.mark.parametrize("order", ["device-first", "default-first"])
def test_a_librarys_executor_kernel_outranks_its_default_in_either_order(order):
    with torch.library._scoped_library("sc_libops_order", "DEF") as lib:
        lib.define("f(Tensor x) -> Tensor")
        kernels = [("CPU", ADDS["cpu"]), ("CUDA", ADDS["cuda"]), ("CompositeExplicitAutograd", ADDS["default"])]
        for key, add in kernels if order == "device-first" else kernels[::-1]:
            lib.impl("f", lambda x, add=add: x + add, key)
        x = torch.arange(3.0)
        assert torch.equal(torch.ops.sc_libops_order.f(_superchip(x)).cpu(), x + ADDS[EXECUTOR])


def test_autograd_and_mutation_through_a_forwarded_op_as_on_cpu():
    @torch.library.custom_op("sc_libops::scale", mutates_args=())
    def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w + ADDS["default"]

    for device in ("cpu", "cuda"):
        scale.register_kernel(device)(lambda x, w, d=device: x * w + ADDS[d])

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x

    scale.register_autograd(backward, setup_context=setup)

    @torch.library.custom_op("sc_libops::bump_", mutates_args=("x",))
    def bump_(x: torch.Tensor) -> None:
        x.add_(ADDS["default"])

    def bump_by(add):
        def kernel(x):
            x.add_(add)
        return kernel

    for device in ("cpu", "cuda"):
        bump_.register_kernel(device)(bump_by(ADDS[device]))

    torch.manual_seed(0)
    x0, w0 = torch.randn(5), torch.randn(5)
    runs = {}
    for device in (EXECUTOR, "superchip"):  # the executor's own tensors are the reference
        x, w = x0.to(device).detach().requires_grad_(), w0.to(device).detach().requires_grad_()
        y = scale(x, w)
        (y * y).sum().backward()
        buf = torch.zeros(3, device=device)
        version = buf._version
        bump_(buf)
        assert buf._version > version  # the write is seen by autograd's version counter
        runs[device] = [t.detach().cpu() for t in (y, x.grad, w.grad, buf)]
    assert runs["superchip"][3].eq(ADDS[EXECUTOR]).all()
    for got, want in zip(runs["superchip"], runs[EXECUTOR]):
        assert torch.equal(got, want)


def test_a_superchip_kernel_registered_by_the_library_is_kept():
    with torch.library._scoped_library("sc_libops_own", "DEF") as lib:
        lib.define("before(Tensor x) -> Tensor")
        lib.define("after(Tensor x) -> Tensor")
        # Its own superchip kernel first, then the device and default ones.
        lib.impl("before", lambda x: x + 7, "PrivateUse1")
        for key, add in (("CPU", ADDS["cpu"]), ("CUDA", ADDS["cuda"]), ("CompositeExplicitAutograd", ADDS["default"])):
            lib.impl("before", lambda x, add=add: x + add, key)
            lib.impl("after", lambda x, add=add: x + add, key)
        # ...or after them (and after superchip's forwarding kernel).
        lib.impl("after", lambda x: x + 7, "PrivateUse1")
        x = torch.zeros(2)
        assert torch.equal(torch.ops.sc_libops_own.before(_superchip(x)).cpu(), x + 7)
        assert torch.equal(torch.ops.sc_libops_own.after(_superchip(x)).cpu(), x + 7)


def test_a_custom_op_factory_runs_the_executors_kernel_for_superchip():
    """Note [Factories of other libraries]: a custom_op without tensor arguments is dispatched
    on its device argument, and device="superchip" raised "does not have a kernel registered
    for superchip" where the executor's device had one."""

    def factory(name, kernels, device_types=None):
        @torch.library.custom_op(f"sc_libops::{name}", mutates_args=(), device_types=device_types)
        def make(n: int, device: torch.device) -> torch.Tensor:
            return torch.full((n,), ADDS["cpu" if device_types else "default"], device=device)

        if kernels:  # in one call: torch 2.11 refuses a factory's second register_kernel
            make.register_kernel(kernels)(lambda n, device: torch.full((n,), ADDS.get(device.type, 7.0), device=device))
        return make

    superchip_device = torch.device("superchip")
    n = 1 << 16
    # Per-device kernels and a default: the executor's kernel, its result in superchip's memory.
    make = factory("make", ("cpu", "cuda"))
    before = superchip.memory_stats()["hbm.allocated_bytes"]
    y = make(n, superchip_device)
    assert y.device.type == "superchip"
    assert superchip.memory_stats()["hbm.allocated_bytes"] - before == 4 * n
    assert torch.equal(y.cpu(), torch.full((n,), ADDS[EXECUTOR]))
    assert torch.equal(make(3, device=superchip_device).cpu(), torch.full((3,), ADDS[EXECUTOR]))
    assert torch.equal(make(3, torch.device("cpu")), torch.full((3,), ADDS["cpu"]))  # unchanged
    # custom_op(device_types="cpu"): its function is the CPU kernel, there is no default.
    cpu_only = factory("make_cpu_only", (), device_types="cpu")
    if EXECUTOR == "cpu":
        assert torch.equal(cpu_only(3, superchip_device).cpu(), torch.full((3,), ADDS["cpu"]))
    else:  # as for a CUDA tensor: torch's error, naming superchip
        with pytest.raises(RuntimeError, match="does not have a kernel registered for superchip"):
            cpu_only(3, superchip_device)
    # A library's own superchip kernel is the one that runs.
    own = factory("make_own", ("cpu", "cuda", "superchip"))
    assert torch.equal(own(3, superchip_device).cpu(), torch.full((3,), 7.0))


def test_the_forwarding_goes_with_the_library_that_called_for_it():
    has_superchip_kernel = lambda: torch._C._dispatch_has_kernel_for_dispatch_key("sc_libops_scoped::f", "PrivateUse1")
    with torch.library._scoped_library("sc_libops_scoped", "DEF") as lib:
        lib.define("f(Tensor x) -> Tensor")
        for key, add in (("CPU", ADDS["cpu"]), ("CUDA", ADDS["cuda"]), ("CompositeExplicitAutograd", ADDS["default"])):
            lib.impl("f", lambda x, add=add: x + add, key)
        assert has_superchip_kernel()
        assert torch.equal(torch.ops.sc_libops_scoped.f(_superchip(torch.zeros(1))).cpu(), torch.tensor([ADDS[EXECUTOR]]))
    # The name defined again, as a decomposition only: a superchip kernel left behind would
    # take autograd's place (CompositeImplicitAutograd serves autograd only where no backend
    # kernel exists) and the gradient would be lost.
    with torch.library._scoped_library("sc_libops_scoped", "DEF") as lib:
        lib.define("f(Tensor x) -> Tensor")
        lib.impl("f", lambda x: x * 3, "CompositeImplicitAutograd")
        assert not has_superchip_kernel()
        x = _superchip(torch.ones(2)).requires_grad_()
        torch.ops.sc_libops_scoped.f(x).sum().backward()
        assert torch.equal(x.grad.cpu(), torch.full((2,), 3.0))


def test_ops_registered_before_superchip_is_imported():
    out = run_python(textwrap.dedent("""
        import json, torch
        lib = torch.library.Library("sc_libops_early", "DEF")
        lib.define("f(Tensor x) -> Tensor")
        lib.impl("f", lambda x: x + 1, "CPU")
        lib.impl("f", lambda x: x + 3, "CUDA")
        lib.impl("f", lambda x: x + 2, "CompositeExplicitAutograd")
        @torch.library.custom_op("sc_libops_early::make", mutates_args=())
        def make(n: int, device: torch.device) -> torch.Tensor:
            return torch.full((n,), 2.0, device=device)
        make.register_kernel(("cpu", "cuda"))(
            lambda n, device: torch.full((n,), {"cpu": 1.0, "cuda": 3.0}[device.type], device=device))
        import superchip
        y = torch.ops.sc_libops_early.f(torch.zeros(1, device="superchip"))
        z = make(1, torch.device("superchip"))
        print(json.dumps([y.item(), z.item(), z.device.type]))
    """))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [ADDS[EXECUTOR], ADDS[EXECUTOR], "superchip"]


def test_ops_registered_from_cpp_after_import_are_checked_when_looked_up():
    """An extension module's own import registers its operators from C++, past torch.library's
    Python wrappers: superchip checks such an operator when torch.ops first resolves it.
    torch._C._dispatch_library is the C++ Library a TORCH_LIBRARY block makes."""
    lib = torch._C._dispatch_library("DEF", "sc_libops_cpp", "")
    lib.define("f(Tensor x) -> Tensor", "", ())
    for key, add in (("CPU", ADDS["cpu"]), ("CUDA", ADDS["cuda"]), ("CompositeExplicitAutograd", ADDS["default"])):
        lib.impl("f", key, lambda x, add=add: x + add, False)
    try:
        y = torch.ops.sc_libops_cpp.f(_superchip(torch.zeros(1)))
        assert y.item() == ADDS[EXECUTOR]
    finally:
        superchip._library._FORWARDED.pop("sc_libops_cpp::f").destroy()
        lib.reset()
        # torch.ops' cached packet goes too, as with a Library's destruction (torch's export
        # utilities walk the cache and would trip on an operator no longer defined).
        namespace = torch.ops.sc_libops_cpp
        if "f" in vars(namespace):
            delattr(namespace, "f")
            namespace._dir.remove("f")


def test_bitsandbytes_optimizer_and_4bit_layer_as_on_cpu():
    """bitsandbytes (scripts/setup.sh installs it) registers a CPU and a CUDA kernel and a default
    one for most of its operators. Its 32-bit AdamW differed from the CPU in the last bits before.
    In a fresh process: bitsandbytes keeps superchip tensors in its caches."""
    pytest.importorskip("bitsandbytes")
    if EXECUTOR != "cpu":
        pytest.skip("compares with bitsandbytes' CPU kernels bit for bit")
    out = run_python(textwrap.dedent("""
        import json, torch, superchip
        import bitsandbytes as bnb
        torch.manual_seed(0)
        w0, grads = torch.randn(4096), [torch.randn(4096) for _ in range(3)]
        layer = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
        x0 = torch.randn(4, 64, dtype=torch.bfloat16)
        runs = {}
        for device in ("cpu", "superchip"):
            p = torch.nn.Parameter(w0.clone().to(device))
            opt = bnb.optim.AdamW([p], lr=1e-2)
            for g in grads:
                p.grad = g.to(device)
                opt.step()
            q = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(layer.weight.detach().clone(), requires_grad=False, quant_type="nf4")
            q = q.to(device).train()
            x = x0.to(device).detach().requires_grad_()
            y = q(x)
            y.float().square().sum().backward()
            runs[device] = [p.detach().cpu(), y.detach().cpu(), x.grad.cpu()]
        print(json.dumps([torch.equal(a, b) for a, b in zip(runs["superchip"], runs["cpu"])]))
    """), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True, True]


def test_an_in_place_op_on_streamed_weights_is_seen_by_the_next_pass():
    """An optimizer-style custom op (bitsandbytes' updates are such) writing weights that live in
    host and are streamed through hbm: every write lands in the weight, and the next forward
    reads it, not a staged copy from before."""
    out = run_python(textwrap.dedent("""
        import json, torch, superchip

        @torch.library.custom_op("sc_libops_stream::axpy_", mutates_args=("p",))
        def axpy_(p: torch.Tensor, g: torch.Tensor, a: float) -> None:
            p.add_(g, alpha=2 * a)  # the default: not what the executor runs

        def axpy_kernel(p, g, a):
            p.add_(g, alpha=a)

        for device in ("cpu", "cuda"):
            axpy_.register_kernel(device)(axpy_kernel)

        def build():
            torch.manual_seed(0)
            return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])

        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))

        def train(model, device, update):
            for _ in range(8):
                model(x.to(device)).square().mean().backward()
                with torch.no_grad():
                    for p in model.parameters():
                        update(p, p.grad, -1e-3)
                        p.grad = None
            return [p.detach().cpu() for p in model.parameters()]

        want = train(build(), "cpu", lambda p, g, a: p.add_(g, alpha=a))
        model = build().to("superchip")
        in_host = sum(superchip.tier_of(p) == "host" for p in model.parameters())
        got = train(model, "superchip", axpy_)
        err = max((a - b).abs().max().item() for a, b in zip(want, got))
        print(json.dumps(dict(in_host=in_host, hits=superchip.stream_stats()["hits"],
                              equal=all(torch.equal(a, b) for a, b in zip(want, got)), err=err)))
    """), env=dict(SUPERCHIP_HBM_BYTES="1M"), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["in_host"] > 0 and r["hits"] > 0, r  # weights streamed through staged copies
    if EXECUTOR == "cpu":
        assert r["equal"], r
    else:
        assert r["err"] < 1e-5, r


@pytest.mark.parametrize("name", ["PagedAdamW", "PagedAdamW8bit"])
def test_bitsandbytes_paged_optimizers_keep_their_state_in_superchips_tiers(name):
    """Note [Paged optimizer state] (python/superchip/_bitsandbytes.py): for a parameter of 10^5
    elements or more a paged optimizer allocated its state in CUDA unified memory, which failed
    at the first step on superchip ("cget_managed_ptr not available" on the CPU executor; a CPU
    tensor beside a superchip parameter on the CUDA executor). The state is now a superchip
    tensor, placed by the tiers: past a small hbm budget, in host."""
    pytest.importorskip("bitsandbytes")
    if EXECUTOR != "cpu":
        pytest.skip("compares with bitsandbytes' CPU kernels bit for bit")
    out = run_python(textwrap.dedent(f"""
        import json, torch, superchip
        import bitsandbytes as bnb
        torch.manual_seed(0)
        w0, grads = torch.randn(512, 512), [torch.randn(512, 512) for _ in range(3)]
        runs = {{}}
        for device in ("cpu", "superchip"):
            p = torch.nn.Parameter(w0.clone().to(device))
            opt = bnb.optim.{name}([p], lr=1e-2)
            for g in grads:
                p.grad = g.to(device)
                opt.step()
            runs[device] = p.detach().cpu()
            if device == "superchip":
                state = [t for t in opt.state[p].values() if torch.is_tensor(t) and t.numel() >= 10**5]
                tiers = sorted({{superchip.tier_of(t) for t in state}})
        s = superchip.memory_stats()
        print(json.dumps(dict(equal=torch.equal(runs["cpu"], runs["superchip"]), tiers=tiers, n=len(state),
                              peak=s["hbm.peak_allocated_bytes"], budget=s["hbm.capacity_bytes"])))
    """), env=dict(SUPERCHIP_HBM_BYTES="256K"), timeout=300)  # less than any state tensor
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["equal"] and r["n"] == 2, r
    assert r["tiers"] == ["host"] and r["peak"] <= r["budget"], r
