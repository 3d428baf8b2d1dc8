"""scaled_dot_product_attention cases for test_attention.py, free of superchip so that the
plain-CUDA reference can run in a child process that never imports it (Note [CUDA reference in
its own process], parity_train.py):

    python sdpa_cases.py OUT.pt     # torch.save({case: run_case(case, "cuda")}) of CUDA_CASES
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

# name -> (q heads, kv heads, seq q, seq kv, head dim, dtype, options)
CASES = {
    "fp32": (4, 4, 16, 16, 32, torch.float32, {}),
    "fp32 causal": (4, 4, 16, 16, 32, torch.float32, {"is_causal": True}),
    "bf16 causal": (4, 4, 16, 16, 64, torch.bfloat16, {"is_causal": True}),
    "fp16 head dim 36": (4, 4, 16, 16, 36, torch.float16, {}),
    "fp64": (2, 2, 8, 8, 16, torch.float64, {}),
    "bool mask": (4, 4, 16, 24, 32, torch.float32, {"mask": torch.bool}),
    "float mask with grad": (4, 4, 16, 24, 32, torch.float32, {"mask": torch.float32, "mask_grad": True}),
    "gqa": (8, 2, 16, 16, 64, torch.bfloat16, {"enable_gqa": True}),
    "dropout": (4, 4, 16, 16, 32, torch.float32, {"dropout_p": 0.25}),
    "last dim strided": (4, 4, 16, 16, 32, torch.float32, {"transposed": True}),
    "math only": (4, 4, 16, 16, 32, torch.float32, {"backends": [SDPBackend.MATH]}),
    "no grad": (4, 4, 16, 16, 32, torch.float32, {"no_grad": True}),
}

# On CUDA the cases whose kernels are deterministic under torch.use_deterministic_algorithms
# and draw no random numbers (dropout masks come from another generator state in another
# process; the math route's bmm needs CUBLAS_WORKSPACE_CONFIG).
CUDA_CASES = ["fp32", "fp32 causal", "bf16 causal", "fp16 head dim 36", "float mask with grad", "gqa",
              "no grad"]


class AttentionOps(TorchDispatchMode):
    """Records the names of the attention kernels that run (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "attention" in name:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def make_inputs(case: str):
    hq, hkv, sq, skv, d, dtype, opt = CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    q = torch.randn(2, hq, sq, d, generator=gen).to(dtype)
    k = torch.randn(2, hkv, skv, d, generator=gen).to(dtype)
    v = torch.randn(2, hkv, skv, d, generator=gen).to(dtype)
    mask = None
    if opt.get("mask") is torch.bool:
        mask = torch.rand(2, 1, sq, skv, generator=gen) > 0.3
    elif opt.get("mask") is not None:
        mask = torch.randn(2, hq, sq, skv, generator=gen).to(dtype)
    grad_out = torch.randn(2, hq, sq, d, generator=gen).to(dtype)
    return q, k, v, mask, grad_out


def run_case(case: str, device: str):
    """(attention kernels that ran, output, gradients of q, k, v and the mask), on the CPU."""
    *_, opt = CASES[case]
    q, k, v, mask, grad_out = make_inputs(case)
    grad = not opt.get("no_grad")
    if opt.get("transposed"):  # last dimension not contiguous
        q, k, v = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
    leaves = [t.to(device).requires_grad_(grad) for t in (q, k, v)]
    if mask is not None:
        mask = mask.to(device).requires_grad_(bool(opt.get("mask_grad")))
    torch.manual_seed(7)
    ops = AttentionOps()
    backends = sdpa_kernel(opt["backends"]) if "backends" in opt else contextlib.nullcontext()
    with backends, ops:
        out = F.scaled_dot_product_attention(
            *leaves, attn_mask=mask, dropout_p=opt.get("dropout_p", 0.0),
            is_causal=opt.get("is_causal", False), enable_gqa=opt.get("enable_gqa", False))
        grads = []
        if grad:
            inputs = leaves + ([mask] if mask is not None and mask.requires_grad else [])
            grads = torch.autograd.grad(out, inputs, grad_out.to(device))
    return ops.names, out.detach().cpu(), [g.cpu() for g in grads]


if __name__ == "__main__":
    torch.use_deterministic_algorithms(True)
    torch.save({case: run_case(case, "cuda") for case in CUDA_CASES}, sys.argv[1])
