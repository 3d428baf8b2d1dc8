"""OpInfo all-dtype sweep: every op of ``op_db`` at every dtype CPU supports for it, forward
and (where the op has autograd at that dtype) gradients, superchip against CPU.

``test_opinfo_sweep.py`` checks every op at one dtype (float32) on several samples; this sweep
widens it to every (op, dtype) pair of ``op.supported_dtypes("cpu")`` (6,121 pairs in torch
2.13) and adds gradients: for the pairs in ``op.supported_backward_dtypes("cpu")`` of ops with
``supports_autograd`` (2,731), the samples are made with ``requires_grad=True``, the outputs
selected by the sample's ``output_process_fn_grad`` are differentiated with
``torch.autograd.grad`` against the same seeded ``grad_outputs`` on both devices, and every
input gradient is compared (a ``None`` gradient must be ``None`` on both).

Sampling (CI budget): each pair runs on the first ``MAX_SAMPLES`` sample inputs only (the
samples of ``op.sample_inputs`` in their order, so the subset is deterministic). The pairs are
split round-robin by op over ``SHARDS`` worker processes that run side by side with one
intra-op thread each (``sweep_runner.py``; a pair that kills its worker is a failure of both
checks). About 70 s on 2 cores.

Inputs move with their sizes, strides and storage offset, random ops are seeded identically,
``SHAPE_ONLY``/``SKIPS``/``CPU_ONLY_ARGS`` and PyTorch's cpu decorations of
``TestCommon.test_compare_cpu`` apply as in the float32 sweep (``test_opinfo_sweep.py``).
Gradients are not compared where PyTorch skips ``TestGradients.test_fn_grad`` on cpu (a cpu
*expected failure* of a gradient test says the gradient disagrees with finite differences,
which does not matter for a CPU comparison, so only skips carry over).

Outcomes are per (op, dtype) and per check (``forward``, ``grad``): ``pass``, ``fail``,
``xfail``/``xpass`` (PyTorch expects the forward check to fail on cpu), ``skip``, ``n/a``
(the CPU reference raised on every sample, or, for ``grad``, no sample had a differentiable
output). ``test_opinfo_dtypes_sweep_summary`` prints the counts per check and per dtype and
every failure, and asserts that each check passes at least ``MIN_PASS_FRACTION`` of the pairs
it ran (pass + xpass over pass + xpass + fail + xfail; skips and n/a are listed, not run).
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections import Counter

import torch
from torch.testing._internal.common_methods_invocations import op_db

import superchip  # noqa: F401

from cpu_overrides import sweep_mark
from helpers import DEVICE
from sweep_runner import run_shards, worker
from test_opinfo_sweep import (CPU_ONLY_ARGS, SHAPE_ONLY, SKIPS, _compare, _move,
                               _move_tensor, _op_id, as_cuda_rules)

MAX_SAMPLES = 8
SHARDS = 2
MIN_PASS_FRACTION = 0.98
GRAD_TEST = ("TestGradients", "test_fn_grad")

# torch picks linear_cross_entropy's chunked algorithm per device type in Python.
_LCE_AUTO = ("torch resolves LinearCrossEntropyOptions.acc_policy='auto' per device type in "
             "Python (LinearCrossEntropyOptions._adjust): fp32 accumulation ('accurate') on "
             "cpu, fp16/bf16 accumulation (the 'compact' fallback) on any other device, so "
             "superchip runs a different algorithm than CPU and its low-precision gradients "
             "differ by a few ulp (the forward agrees within tolerance and is compared)")

# (op id, dtype name, check) -> reason: checks of one pair not made (test/README.md).
PAIR_SKIPS: dict[tuple[str, str, str], str] = {
    (f"nn.functional.linear_cross_entropy.{variant}", dtype, "grad"): _LCE_AUTO
    for variant in ("chunked", "chunked_none") for dtype in ("bfloat16", "float16")
}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pairs(op) -> list[torch.dtype]:
    """The dtypes the sweep runs ``op`` at: every dtype CPU supports, in a fixed order."""
    return sorted(op.supported_dtypes("cpu"), key=str)


def _grad_enabled(op, dtype) -> bool:
    return bool(op.supports_autograd) and dtype in op.supported_backward_dtypes("cpu")


# ---- running one sample on one device -------------------------------------------------------

def _leaves(obj, device, out: list):
    """``obj`` with every tensor moved to ``device`` (see ``_move``); tensors that require grad
    become fresh leaves there, appended to ``out`` in argument order."""
    if isinstance(obj, torch.Tensor):
        moved = _move_tensor(obj.detach(), device)
        if obj.requires_grad:
            moved.requires_grad_(True)
            out.append(moved)
        return moved
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_leaves(o, device, out) for o in obj)
    if isinstance(obj, dict):
        return {k: _leaves(v, device, out) for k, v in obj.items()}
    return _move(obj, device)


def _flat_tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat_tensors(o)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _flat_tensors(v)]
    return []


def _grad_outputs(outputs: list) -> list:
    """Seeded random cotangents, made on CPU in double precision and cast, so both devices
    differentiate against the same values."""
    gen = torch.Generator().manual_seed(4321)
    grads = []
    for out in outputs:
        wide = torch.complex128 if out.dtype.is_complex else torch.float64
        grads.append(torch.randn(out.shape, dtype=wide, generator=gen).to(out.dtype))
    return grads


def _run(op, sample, device, name, with_grad: bool):
    """(forward result, input gradients or None) of ``op`` on ``sample`` at ``device``."""
    inputs: list = []
    if name in CPU_ONLY_ARGS:
        args = (_leaves(sample.input, device, inputs), *sample.args)
    else:
        args = _leaves((sample.input, *sample.args), device, inputs)
    kwargs = _leaves(dict(sample.kwargs), device, inputs)
    if not with_grad:
        inputs = []
    torch.manual_seed(1234)
    with torch.set_grad_enabled(bool(inputs)):
        result = op(*args, **kwargs)
    if not inputs:
        return result, None
    outs = [t for t in _flat_tensors(sample.output_process_fn_grad(result))
            if t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)]
    if not outs:
        return result, None
    grads_out = [g.to(device) for g in _grad_outputs(outs)]
    grads = torch.autograd.grad(outs, inputs, grads_out, allow_unused=True)
    return result, grads


def _first_line(exc: Exception) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {(msg[0] if msg else '')[:200]}"


def check_pair(op, dtype) -> dict[str, tuple[str, str]]:
    """Runs ``op`` at ``dtype``; returns {"forward": (outcome, detail), "grad": (...)} (no
    "grad" entry when the op has no autograd at ``dtype``)."""
    name = _op_id(op)
    grad = _grad_enabled(op, dtype)
    res: dict[str, tuple[str, str]] = {}
    skip = SKIPS.get(name) or PAIR_SKIPS.get((name, _dtype_name(dtype), "forward"))
    mark = ("skip", skip) if skip else sweep_mark(op, dtype)
    if mark is not None and mark[0] == "skip":
        res["forward"] = mark
        if grad:
            res["grad"] = mark
        return res
    grad_skip = PAIR_SKIPS.get((name, _dtype_name(dtype), "grad"))
    grad_mark = (("skip", grad_skip) if grad_skip else sweep_mark(op, dtype, GRAD_TEST)
                 if grad else None)
    if grad_mark is not None and grad_mark[0] == "skip":
        res["grad"] = grad_mark
        grad = False
    fwd, bwd = _check_samples(op, name, dtype, grad)
    if mark is not None and mark[0] == "xfail":
        if fwd[0] == "fail":
            fwd = ("xfail", f"{mark[1]}; {fwd[1]}")
        elif fwd[0] == "pass":
            fwd = ("xpass", f"{mark[1]}, but it matched CPU ({fwd[1]})")
    res["forward"] = fwd
    if grad:
        res["grad"] = bwd
    return res


def _check_samples(op, name, dtype, grad: bool):
    try:
        samples = list(itertools.islice(
            op.sample_inputs("cpu", dtype, requires_grad=grad), MAX_SAMPLES))
    except Exception as exc:  # noqa: BLE001  (op_db's own sample generator)
        na = ("n/a", f"sample_inputs raised {type(exc).__name__}")
        return na, na
    shape_only = name in SHAPE_ONLY or op.name in SHAPE_ONLY
    fwd_ran = grad_ran = 0
    fwd_fail = grad_fail = None
    for i, sample in enumerate(samples):
        with_grad = grad
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    expected, expected_grads = _run(op, sample, "cpu", name, with_grad)
                except Exception:  # noqa: BLE001  (e.g. an in-place op on a leaf)
                    if not with_grad:
                        raise
                    with_grad = False
                    expected, expected_grads = _run(op, sample, "cpu", name, False)
        except Exception:  # noqa: BLE001  (reference raised: sample not applicable)
            continue
        where = f"sample {i} ({dtype})"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                actual, actual_grads = _run(op, sample, DEVICE, name, with_grad)
        except Exception as exc:  # noqa: BLE001
            fwd_fail = fwd_fail or f"{where}: {_first_line(exc)}"
            if expected_grads is not None:
                grad_fail = grad_fail or f"{where}: forward raised: {_first_line(exc)}"
            continue
        try:
            _compare(actual, as_cuda_rules(name, expected, sample), shape_only)
            fwd_ran += 1
        except Exception as exc:  # noqa: BLE001
            fwd_fail = fwd_fail or f"{where}: {_first_line(exc)}"
        if expected_grads is None:
            continue
        try:
            assert actual_grads is not None, "no differentiable output on superchip"
            for k, (a, e) in enumerate(zip(actual_grads, expected_grads)):
                assert (a is None) == (e is None), f"grad {k}: {a is None=} != {e is None=}"
                if e is not None:
                    _compare(a, e, shape_only)
            grad_ran += 1
        except Exception as exc:  # noqa: BLE001
            grad_fail = grad_fail or f"{where} grad: {_first_line(exc)}"
    fwd = (("fail", fwd_fail) if fwd_fail else ("pass", f"{fwd_ran} samples") if fwd_ran
           else ("n/a", "CPU reference raised on every sample"))
    bwd = (("fail", grad_fail) if grad_fail else ("pass", f"{grad_ran} samples") if grad_ran
           else ("n/a", "no sample with a differentiable output"))
    return fwd, bwd


# ---- worker processes -----------------------------------------------------------------------

def _units(shard: int) -> list[tuple[str, tuple[int, str]]]:
    """The shard's (op, dtype) pairs: ops round-robin over the shards, dtypes in order."""
    return [(f"{_op_id(op)}@{_dtype_name(dtype)}", (i, _dtype_name(dtype)))
            for i, op in enumerate(op_db) if i % SHARDS == shard for dtype in pairs(op)]


def _check_unit(arg) -> dict:
    index, dtype = arg
    return check_pair(op_db[index], getattr(torch, dtype))


def run_sweep(tmp_path) -> dict[str, dict[str, tuple[str, str]]]:
    """{"op@dtype": {check: (outcome, detail)}}; a pair that kills its worker fails both
    checks ("crashed the process")."""
    results = run_shards(__file__, SHARDS, tmp_path, tag="dtypes",
                         crash_result=lambda msg: {"forward": ("fail", msg),
                                                   "grad": ("fail", msg)})
    return {uid: {c: tuple(v) for c, v in res.items()} for uid, res in results.items()}


def test_opinfo_dtypes_sweep_summary(tmp_path):
    results = run_sweep(tmp_path)
    expected_units = sum(len(pairs(op)) for op in op_db)
    assert len(results) == expected_units, (len(results), expected_units)
    rates = {}
    for check in ("forward", "grad"):
        by_outcome: dict[str, list[str]] = {o: [] for o in ("pass", "xpass", "fail", "xfail",
                                                             "skip", "n/a")}
        per_dtype: dict[str, Counter] = {}
        for uid, res in results.items():
            if check in res:
                outcome = res[check][0]
                by_outcome[outcome].append(uid)
                per_dtype.setdefault(uid.rsplit("@", 1)[1], Counter())[outcome] += 1
        passed = len(by_outcome["pass"]) + len(by_outcome["xpass"])
        ran = passed + len(by_outcome["fail"]) + len(by_outcome["xfail"])
        rates[check] = (passed, ran)
        total = sum(len(v) for v in by_outcome.values())
        samples = sum(int(results[uid][check][1].split()[0]) for uid in by_outcome["pass"])
        print(f"\nOpInfo all-dtype sweep, {check}: {passed} / {ran} (op, dtype) pairs run pass "
              f"({passed / max(ran, 1):.4f}; {samples} samples in the passing pairs); "
              f"{len(by_outcome['fail'])} fail, "
              f"{len(by_outcome['xfail'])} fail as expected on cpu, "
              f"{len(by_outcome['xpass'])} pass though expected to fail on cpu, "
              f"{len(by_outcome['skip'])} skipped, {len(by_outcome['n/a'])} not applicable, "
              f"{total} pairs in all (up to {MAX_SAMPLES} samples each)")
        for dtype, counts in sorted(per_dtype.items()):
            print(f"  {dtype:16s} " + " ".join(f"{o}={counts[o]}" for o in by_outcome
                                                if counts[o]))
        for outcome in ("fail", "xfail", "xpass", "skip", "n/a"):
            for uid in sorted(by_outcome[outcome]):
                print(f"  {outcome:5s} {uid}: {results[uid][check][1]}")
    for check, (passed, ran) in rates.items():
        assert passed / max(ran, 1) >= MIN_PASS_FRACTION, (
            f"{check}: only {passed}/{ran} (op, dtype) pairs pass on superchip "
            f"(need {MIN_PASS_FRACTION})")


if __name__ == "__main__":
    worker(_units(int(sys.argv[1])), _check_unit, int(sys.argv[2]), sys.argv[3])
