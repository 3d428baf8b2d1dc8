"""scaled_dot_product_attention on superchip runs the executor's own kernel (Note [Attention
on superchip], backend/native/Attention.h): the kernel CPU (or CUDA) picks for the same
inputs, with its bits, forward and backward.

With the CPU executor the reference runs in this process. With the CUDA executor it runs in a
child that never imports superchip (Note [CUDA reference in its own process],
parity_train.py); CUDA's flash kernel is reached through the "overrideable" entry there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import superchip

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sdpa_cases import CASES, CUDA_CASES, run_case  # noqa: E402
from helpers import run_python  # noqa: E402

EXECUTOR = superchip.executor()

# The name superchip's route gives CUDA's flash kernel.
THROUGH_OVERRIDEABLE = {
    "_scaled_dot_product_flash_attention": "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_flash_attention_backward": "_scaled_dot_product_fused_attention_overrideable_backward",
}


@pytest.fixture(scope="module")
def cuda_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("sdpa") / "reference.pt"
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "sdpa_cases.py"), str(out)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert proc.returncode == 0, f"the CUDA reference run failed:\n{proc.stderr[-3000:]}"
    return torch.load(out)


def assert_same_run(got, want, case):
    ops, out, grads = got
    want_ops, want_out, want_grads = want
    assert ops == want_ops, f"{case}: superchip ran {ops}, the executor {want_ops}"
    assert out.dtype == want_out.dtype and torch.equal(out, want_out), f"{case}: outputs differ"
    assert len(grads) == len(want_grads)
    for i, (g, w) in enumerate(zip(grads, want_grads)):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{case}: gradient {i} differs"


@pytest.mark.skipif(EXECUTOR != "cpu", reason="the CPU executor's reference runs in-process")
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_takes_the_cpu_kernel_with_its_bits(case):
    assert_same_run(run_case(case, "superchip"), run_case(case, "cpu"), case)


def test_sdpa_runs_a_fused_kernel_where_the_executor_has_one():
    # bf16 with a causal mask: CPU takes its flash kernel; CUDA takes flash (reached through
    # the overrideable entry), or cuDNN's where it prefers it. Before Note [Attention on
    # superchip], the CUDA executor always took the math decomposition (no attention kernel).
    ops, _, _ = run_case("bf16 causal", "superchip")
    fused = {"cpu": {"_scaled_dot_product_flash_attention_for_cpu"},
             "cuda": {"_scaled_dot_product_fused_attention_overrideable",
                      "_scaled_dot_product_cudnn_attention"}}[EXECUTOR]
    assert ops and ops[0] in fused, ops
    # sdpa_kernel's restriction is honoured: the math decomposition runs no attention kernel.
    ops, _, _ = run_case("math only", "superchip")
    assert ops == [], ops


@pytest.mark.skipif(EXECUTOR != "cuda", reason="needs the CUDA executor (a GPU)")
@pytest.mark.parametrize("case", CUDA_CASES)
def test_sdpa_takes_the_cuda_kernel_with_its_bits(case, cuda_reference):
    want_ops, want_out, want_grads = cuda_reference[case]
    want_ops = [THROUGH_OVERRIDEABLE.get(name, name) for name in want_ops]
    torch.use_deterministic_algorithms(True)
    try:
        got = run_case(case, "superchip")
    finally:
        torch.use_deterministic_algorithms(False)
    assert_same_run(got, (want_ops, want_out, want_grads), case)


def test_overrideable_entry_refuses_a_mask():
    if EXECUTOR != "cuda":
        pytest.skip("the overrideable entry is superchip's route to CUDA's flash kernel")
    q = torch.randn(1, 2, 8, 16, device="superchip", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="takes no attn_bias.*scaled_dot_product_attention"):
        torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, q, q, torch.zeros(8, 8, device="superchip"))


# ---- the overrideable entry without a GPU (Note [Emulating CUDA's flash entry]) ----

EMULATED_FLASH = r'''
import math, torch, superchip, torch.nn.functional as F
aten = torch.ops.aten
calls = []

def attention(q, k, v, is_causal, scale):
    """Attention in float32 with CUDA flash's conventions (GQA by repeating k and v): the
    output, the log-sum-exp of each row and the probabilities."""
    rep = q.size(1) // k.size(1)
    kf, vf = (t.float().repeat_interleave(rep, 1) for t in (k, v))
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ vf).to(q.dtype), torch.logsumexp(s, -1), s.softmax(-1), kf, vf, rep

# CPU kernels standing in for CUDA's flash forward and backward (same schema and outputs).
def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    calls.append(("forward", q.size(-1), scale))
    out, lse, *_ = attention(q, k, v, is_causal, scale)
    # The dropout state as CUDA returns it: two uint64 words (seed, offset), an unused scalar.
    return (out, lse, torch.empty(0), torch.empty(0), q.size(2), k.size(2),
            torch.tensor([1234, 5678], dtype=torch.uint64), torch.zeros((), dtype=torch.uint64),
            torch.empty(0))

def flash_backward(g, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, seed, offset, *, scale=None):
    calls.append(("backward", g.size(-1), out.size(-1), scale, out.clone(), g.clone(),
                  (seed.dtype, tuple(seed.shape), seed.view(torch.int64).tolist())))
    _, _, p, kf, vf, rep = attention(q, k, v, is_causal, scale)
    gf = g.float()
    dp = gf @ vf.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk, dv = (ds @ kf) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, p.transpose(-1, -2) @ gf
    b, h, s, d = dk.shape
    dk, dv = (t.view(b, h // rep, rep, s, t.size(-1)).sum(2) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

lib = torch.library.Library("aten", "IMPL")
lib.impl("_scaled_dot_product_flash_attention", flash, "CPU")
lib.impl("_scaled_dot_product_flash_attention_backward", flash_backward, "CPU")

def cuda_branch(q, k, v, g, is_causal, scale):
    """sdpa's CUDA flash branch (ATen attention.cpp) over CPU tensors: head dim padded to a
    multiple of 8, the unpadded dimension's scale, the output narrowed; autograd through it."""
    d = q.size(-1)
    padded = [F.pad(t, (0, (8 - d % 8) % 8)) for t in (q, k, v)]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out = aten._scaled_dot_product_flash_attention(*padded, 0.0, is_causal, False, scale=scale)[0][..., :d]
    return out, torch.autograd.grad(out, (q, k, v), g)

for hq, hkv, d, is_causal, scale in [(4, 4, 36, False, None), (4, 4, 64, True, None),
                                     (8, 2, 36, True, 0.3), (4, 4, 20, False, None)]:
    torch.manual_seed(d + hq)
    q, g = (torch.randn(2, hq, 16, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, hkv, 16, d, dtype=torch.bfloat16) for _ in range(2))
    want_out, want_grads = cuda_branch(*[t.clone().requires_grad_() for t in (q, k, v)], g, is_causal, scale)
    calls.clear()
    leaves = [t.to("superchip").requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFusedAttentionOverrideableBackward0", out.grad_fn
    grads = torch.autograd.grad(out, leaves, g.to("superchip"))
    case = (hq, hkv, d, is_causal, scale)
    padded, expected_scale = d + (8 - d % 8) % 8, scale if scale is not None else 1.0 / math.sqrt(d)
    assert [c[:3] if c[0] == "forward" else c[:4] for c in calls] == [
        ("forward", padded, expected_scale), ("backward", padded, padded, expected_scale)], (case, calls)
    # The output and its gradient reach the backward zero-padded, as sdpa's branch leaves them.
    assert not calls[1][4][..., d:].any() and not calls[1][5][..., d:].any(), case
    # The dropout state reaches the backward as the forward returned it (Note [Flash's random
    # state through the overrideable entry]).
    assert calls[1][6] == (torch.uint64, (2,), [1234, 5678]), (case, calls[1][6])
    assert out.stride() == leaves[0].stride(), (case, out.stride(), leaves[0].stride())
    assert torch.equal(out.detach().cpu(), want_out.detach()), (case, "output")
    for i, (a, b) in enumerate(zip(grads, want_grads)):
        assert a.stride() == leaves[i].stride(), (case, i, a.stride())
        assert torch.equal(a.cpu(), b), (case, "gradient", i)
    print("OK", case)

# torch.compile checks the entry's outputs against its meta function (two 0-dim dropout words).
class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

torch.manual_seed(0)
q, k, v, g = (torch.randn(2, 4, 16, 36, dtype=torch.bfloat16) for _ in range(4))
results = []
for fn in (Attention(), torch.compile(Attention())):
    calls.clear()
    leaves = [t.to("superchip").requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    results.append((out.detach().cpu(), [t.cpu() for t in torch.autograd.grad(out, leaves, g.to("superchip"))]))
    assert [c[0] for c in calls] == ["forward", "backward"], calls
    assert calls[1][6] == (torch.uint64, (2,), [1234, 5678]), calls[1][6]
assert torch.equal(results[0][0], results[1][0]), "compiled output"
assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1])), "compiled gradients"
print("OK compiled")
'''


@pytest.mark.skipif(EXECUTOR != "cpu", reason="emulates CUDA's flash kernel on the CPU executor")
def test_overrideable_entry_gives_the_cuda_flash_branch_bits_emulated(tmp_path):
    # The same attention compiled first in a process without the emulation, in the same
    # Inductor cache: its graph (math attention) was reused by the emulated process, whose
    # compiled forward then never reached the flash entry (superchip/_inductor/config.py: the
    # cache key holds the emulation and the executor; found by running the suite on torch 2.11).
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    plain = EMULATED_FLASH[EMULATED_FLASH.index("# torch.compile checks"):].replace(
        'assert [c[0] for c in calls] == ["forward", "backward"], calls', "")
    plain = plain.replace("assert calls[1][6] == (torch.uint64, (2,), [1234, 5678]), calls[1][6]", "")
    proc = run_python("import torch, superchip, torch.nn.functional as F\ncalls = []\n" + plain, env=cache)
    assert proc.returncode == 0 and "OK compiled" in proc.stdout, proc.stderr[-3000:]
    proc = run_python(EMULATED_FLASH, env={"SUPERCHIP_EMULATE_CUDA_FLASH": "1", **cache})
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.stdout.count("OK") == 5, proc.stdout


def test_the_attention_entry_has_fake_rules_both_ways():
    # Point 18 of Note [Why superchip patches Inductor]: without a meta function for the
    # backward (torch 2.11), every trace of a compiled attention backward ran the real kernel
    # on zero-filled superchip tensors.
    for name in ("_scaled_dot_product_fused_attention_overrideable",
                 "_scaled_dot_product_fused_attention_overrideable_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"), name
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 16, 36, device="superchip").transpose(1, 2) for _ in range(3))
        out, lse = torch.empty(2, 16, 4, 36, device="superchip"), torch.empty(2, 4, 16, device="superchip")
        grads = torch.ops.aten._scaled_dot_product_fused_attention_overrideable_backward(
            out, q, k, v, None, [True, True, True, False], out, lse, None, None, 16, 16, 0.0, False,
            torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64))
    assert [tuple(g.shape) for g in grads[:3]] == [(2, 16, 4, 36)] * 3
    assert [g.stride() for g in grads[:3]] == [q.stride(), k.stride(), v.stride()]


# ---- FlexAttention (point 21 of Note [Why superchip patches Inductor]) ----
# torch.nn.attention.flex_attention refused superchip ("FlexAttention is only supported on
# CUDA, CPU, HPU, or MPS devices"), eager and compiled. It now runs as on the executor's device.

def _causal(b, h, q, k):
    return q >= k


def _relative_bias(score, b, h, q, k):
    return score + (q - k) * 0.01


def _flex_inputs(dtype):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 16, dtype=dtype)
    return q, torch.randn(2, 2, 64, 16, dtype=dtype), torch.randn(2, 2, 64, 16, dtype=dtype)


def _flex(device, dtype, compiled, requires_grad=False):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (t.to(device).requires_grad_(requires_grad) for t in _flex_inputs(dtype))
    block_mask = create_block_mask(_causal, 2, None, 64, 64, device=device)
    def attend(q, k, v, block_mask):  # with work before it, as in a model (not after it:
        # the CPU's template takes no epilogue, "Unsupported for `epilogue_nodes`", on the CPU too)
        return flex_attention(q * 1.5, k, v, score_mod=_relative_bias, block_mask=block_mask, enable_gqa=True)

    # fullgraph: a graph break in superchip's device check split models' graphs, and compiled
    # models then differed from compiled CPU's in the last bits.
    attend = torch.compile(attend, fullgraph=True) if compiled else attend
    return attend(q, k, v, block_mask), (q, k, v)


@pytest.mark.skipif(EXECUTOR != "cpu", reason="the CPU executor's FlexAttention is the CPU's (inference)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_gives_the_cpus_bits(compiled):
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            got, _ = _flex("superchip", dtype, compiled)
            want, _ = _flex("cpu", dtype, compiled)
        assert got.device.type == "superchip" and got.dtype == dtype
        assert torch.equal(got.cpu(), want), dtype
    # The CPU has no FlexAttention backward: refused as on the CPU, saying why for superchip.
    # (Under fullgraph, Dynamo reraises it as its Unsupported, the message kept.)
    with pytest.raises(Exception, match="backward on superchip with the CPU executor.*sdpa") as refusal:
        _flex("superchip", torch.float32, compiled, requires_grad=True)
    assert refusal.type is (torch._dynamo.exc.Unsupported if compiled else NotImplementedError)


@pytest.mark.skipif(EXECUTOR != "cuda", reason="needs the CUDA executor (a GPU)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_trains_on_the_cuda_executor(compiled):
    # Eager: torch's dense implementation; compiled: Inductor's Triton templates. The
    # reference is the same attention written out in float64 on the CPU.
    out, inputs = _flex("superchip", torch.float32, compiled, requires_grad=True)
    out.sum().backward()
    q, k, v = (t.detach().double().requires_grad_() for t in _flex_inputs(torch.float64))
    rows, cols = torch.arange(64).view(-1, 1), torch.arange(64).view(1, -1)
    scores = (q * 1.5 @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 4.0 + (rows - cols) * 0.01
    scores = scores.masked_fill(rows < cols, float("-inf"))
    want = scores.softmax(-1) @ v.repeat_interleave(2, 1)
    want.sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), rtol=1e-4, atol=1e-4)
    for got, ref in zip(inputs, (q, k, v)):
        torch.testing.assert_close(got.grad.cpu().double(), ref.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(EXECUTOR != "cpu", reason="the CPU executor's FlexAttention is the CPU's (inference)")
def test_transformers_flex_attention_gives_the_cpus_logits():
    # transformers asks FlexAttention for the log-sum-exp on any device but the CPU, which
    # cannot give one compiled ("return_lse is not supported yet"): asked as on the CPU.
    # Forward only: generate() with FlexAttention fails on the CPU itself (torch's C++ template,
    # "cur_kvSplitSize0 was not declared"). A fresh process: transformers compiles
    # FlexAttention once per process.
    proc = run_python("""
import torch, superchip
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     attn_implementation="flex_attention")
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 128, (2, 24))
mask = torch.ones_like(ids)
mask[1, :5] = 0
logits = {}
for device in ("cpu", "superchip"):
    model.to(device)
    with torch.no_grad():
        logits[device] = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
assert logits["superchip"].device.type == "superchip"
assert torch.equal(logits["superchip"].cpu(), logits["cpu"])
print("OK")
""", timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
