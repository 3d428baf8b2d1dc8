"""Training parity: the example GPT trained on superchip gives the numbers it gives on the
executor's own device (plain CPU in emulated mode), step by step; and the demo runs.

With the CPU executor every superchip kernel is the CPU kernel over the same bytes, so SGD
must match bit for bit. AdamW is allowed 1e-6 relative: torch.optim picks its foreach
implementation for superchip parameters and the per-tensor one for CPU parameters, which may
round differently in the last bit (on torch 2.13 they agree bit for bit). With the CUDA
executor the reference is plain CUDA.

Both sides compute attention the same way: superchip runs the executor's own
scaled_dot_product_attention choice (Note [Attention on superchip]; the CPU's flash kernel
here). With the CUDA executor both sides are forced to the math decomposition: CUDA's fused
attention backward kernels are not deterministic outside torch.use_deterministic_algorithms
(flash accumulates dQ with atomics), so 20 steps could not be compared bit for bit.
test_attention.py compares the fused kernels themselves, in deterministic mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import superchip

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from parity_train import seeded_model, small_config, train  # noqa: E402
from model import GPT  # noqa: E402  (examples/, put on the path by parity_train)

REF_DEVICE = superchip.executor()  # "cpu" or "cuda": the device whose kernels superchip runs


def twin_runs(optimizer: str, tmp_path: Path, **cfg):
    if REF_DEVICE == "cuda":
        # Note [CUDA reference in its own process] (parity_train.py)
        out = tmp_path / f"reference-{optimizer}.pt"
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "parity_train.py"),
                               optimizer, json.dumps(cfg), str(out)],
                              capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
        assert proc.returncode == 0, f"the CUDA reference run failed:\n{proc.stderr}"
        ref = torch.load(out)
        with sdpa_kernel([SDPBackend.MATH]):  # as the reference (module docstring)
            dut = train(seeded_model(**cfg), "superchip", optimizer)
        return ref, dut
    ref = train(seeded_model(**cfg), REF_DEVICE, optimizer)
    dut = train(seeded_model(**cfg), "superchip", optimizer)
    return ref, dut


def assert_tensors(actual, expected, rtol: float, what: str) -> None:
    if rtol == 0.0:
        assert torch.equal(actual, expected), (
            f"{what}: not bitwise equal, max abs diff {(actual - expected).abs().max().item():.3e}")
    else:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=0.0, msg=lambda m: f"{what}: {m}")


def assert_runs_match(ref, dut, rtol: float) -> None:
    (ref_loss, ref_params, ref_state), (loss, params, state) = ref, dut
    assert loss[-1] < loss[0], f"the loss did not decrease: {loss.tolist()}"
    assert_tensors(loss, ref_loss, rtol, "per-step losses")
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        assert_tensors(params[name], ref_params[name], rtol, f"parameter {name}")
        assert state[name].keys() == ref_state[name].keys(), f"optimizer state of {name}"
        for key in ref_state[name]:
            assert_tensors(state[name][key], ref_state[name][key], rtol, f"state {key} of {name}")


# Bitwise holds only where superchip runs the very kernels of its reference: the CPU executor.
# On CUDA, reductions inside cuBLAS/SDPA may differ run to run, so a tolerance applies there.
SGD_RTOL = 0.0 if REF_DEVICE == "cpu" else 1e-5
ADAMW_RTOL = 1e-6 if REF_DEVICE == "cpu" else 1e-5


TIES = [pytest.param(False, id="untied"), pytest.param(True, id="tied")]


@pytest.mark.parametrize("tie_weights", TIES)
def test_sgd_momentum_matches_reference_bitwise(tie_weights, tmp_path):
    ref, dut = twin_runs("sgd", tmp_path, tie_weights=tie_weights)
    assert_runs_match(ref, dut, SGD_RTOL)


@pytest.mark.parametrize("tie_weights", TIES)
def test_adamw_matches_reference(tie_weights, tmp_path):
    ref, dut = twin_runs("adamw", tmp_path, tie_weights=tie_weights)
    assert_runs_match(ref, dut, ADAMW_RTOL)


def test_to_superchip_keeps_tied_weights():
    # nn.Module._apply keeps a shared Parameter shared only if it can swap its data in place,
    # which needs _has_compatible_shallow_copy_type(cpu, superchip) to hold.
    torch.manual_seed(0)
    model = GPT(small_config(tie_weights=True)).to("superchip")
    assert model.head.weight is model.tok_emb.weight
    assert model.head.weight.device.type == "superchip"


def test_demo_smoke():
    env = dict(os.environ)
    # The child must import the same superchip package as this process (a dev tree or a wheel).
    package_root = str(Path(superchip.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--steps", "30", "--log-every", "10",
         "--sample-chars", "40"],
        capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"demo exited {proc.returncode}\n{out}\n{proc.stderr}"
    assert "tokens/s" in out
    assert "loss" in out and "->" in out
    for line_start in ("hbm ", "host "):
        assert any(line.strip().startswith(line_start) and "allocated" in line and "peak" in line
                   for line in out.splitlines()), f"no {line_start.strip()} memory line:\n{out}"
    assert f"executor: {superchip.executor()}" in out
