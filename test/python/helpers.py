"""Small helpers shared by the superchip conformance tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import superchip

from tolerances import tol

DEVICE = torch.device("superchip:0")


def to_device(obj, device):
    """Recursively moves every tensor in ``obj`` (lists, tuples, dicts) to ``device``."""
    if isinstance(obj, torch.Tensor):
        moved = obj.detach().to(device)
        if obj.requires_grad:
            moved.requires_grad_(True)
        return moved
    if isinstance(obj, (list, tuple)):
        moved = [to_device(o, device) for o in obj]
        return type(obj)(moved) if not hasattr(obj, "_fields") else type(obj)(*moved)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def to_cpu(obj):
    return to_device(obj, "cpu")


def assert_close_cpu(actual, expected, **kwargs):
    """``assert_close`` of a superchip result against a CPU reference, tolerance from the table."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual)}"
        assert actual.device.type == "superchip", f"result is on {actual.device}"
        kw = tol(expected.dtype)
        kw.update(kwargs)
        torch.testing.assert_close(actual.cpu(), expected, **kw)
    else:
        torch.testing.assert_close(to_cpu(actual), expected, **kwargs)


def assert_matches_cpu(got, want):
    """A CPU-device result of superchip against CPU's: bit for bit on the CPU executor (the
    same kernels), within the tolerance table on the CUDA executor (CUDA's kernels)."""
    if superchip.executor() == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **tol(want.dtype))


def run_python(code: str, env: dict | None = None, timeout: int = 120):
    """Runs ``code`` in a fresh interpreter (for env-dependent device setup); returns the result."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
