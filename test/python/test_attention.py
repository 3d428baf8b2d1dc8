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
