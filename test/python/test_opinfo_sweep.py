"""OpInfo sweep: every op of PyTorch's ``op_db`` runs on superchip and gives the CPU result.

Each op runs on up to ``MAX_SAMPLES`` sample inputs at float32 (or, for ops without float32 on
CPU, the first dtype of ``FALLBACK_DTYPES`` they support), once on CPU and once with every
tensor moved to superchip. Results come back to CPU and are compared with ``assert_close``
(``equal_nan``, tolerance from ``SWEEP_TOLERANCES``). Random ops are compared after seeding
both runs identically (superchip's generator reproduces the CPU stream); ops whose output is
uninitialised memory are compared on shape/dtype/device only (``SHAPE_ONLY``).

Outcomes per op: ``pass`` (every sample matched), ``fail`` (a sample raised on superchip or
differed), ``skip`` (listed in ``SKIPS``, or skipped by PyTorch on cpu; counts as not
passing), ``xfail`` (PyTorch expects the op to fail on cpu and it failed here too; not
passing), ``xpass`` (expected to fail on cpu, matched CPU here: counted as a pass and listed),
``n/a`` (the CPU reference itself raised or the op has no sample at a supported dtype; not
the backend's fault). The cpu skips and expected failures are PyTorch's own OpInfo
decorations for device_type 'cpu' that apply to ``TestCommon.test_compare_cpu`` (the check
this sweep makes), carried over by ``cpu_overrides.sweep_mark``: the CPU executor runs the
CPU kernels, so their known failures are superchip's too.
``test_opinfo_sweep_summary`` prints the counts and the failures by name and asserts that at
least ``MIN_PASS_FRACTION`` of all op_db entries (n/a and skips included in the denominator
as not passing) pass.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import superchip  # noqa: F401

from cpu_overrides import sweep_mark
from helpers import DEVICE
from sweep_runner import run_shards, worker
from tolerances import SWEEP_TOLERANCES, tol

MAX_SAMPLES = 4
MIN_PASS_FRACTION = 0.90
FALLBACK_DTYPES = (torch.int64, torch.bool, torch.complex64, torch.float64, torch.uint8)

# Ops whose output is uninitialised (or otherwise arbitrary) memory: only shape, dtype and
# device can be compared.
SHAPE_ONLY = {
    "empty": "returns uninitialised memory",
    "empty_like": "returns uninitialised memory",
    "empty_strided": "returns uninitialised memory",
    "empty_permuted": "returns uninitialised memory",
    "new_empty": "returns uninitialised memory",
    "new_empty_strided": "returns uninitialised memory",
    "torch.empty": "returns uninitialised memory",
}

# op name (or "name.variant") -> reason. Every skip counts as "not passing".
SKIPS: dict[str, str] = {}


def _op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _sweep_dtype(op):
    """float32 when the op supports it on CPU, else the first fallback dtype it supports."""
    supported = op.supported_dtypes("cpu")
    if torch.float32 in supported:
        return torch.float32
    for dtype in FALLBACK_DTYPES:
        if dtype in supported:
            return dtype
    return None


def _compare(actual, expected, shape_only: bool):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"got {type(actual).__name__}, want a tensor"
        if expected.device.type == "cpu":
            assert actual.device.type == "superchip", f"result on {actual.device}"
        assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
        assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
        if shape_only:
            return
        a = actual.detach().cpu()
        e = expected.detach()
        if e.layout != torch.strided:
            a, e = a.to_dense(), e.to_dense()
        torch.testing.assert_close(a, e, equal_nan=True, check_device=False,
                                   check_stride=False, **tol(e.dtype, SWEEP_TOLERANCES))
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), (
            f"got {type(actual).__name__} of {len(actual) if hasattr(actual, '__len__') else '?'}"
            f" items, want {len(expected)}")
        for a, e in zip(actual, expected):
            _compare(a, e, shape_only)
    elif isinstance(expected, dict):
        assert set(actual) == set(expected)
        for k in expected:
            _compare(actual[k], expected[k], shape_only)
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, f"{actual} != nan"
    else:
        assert actual == expected, f"{actual!r} != {expected!r}"


# Note [Norm statistics] (backend/native/NormStats.h): the statistics batch and layer norm
# save for their backward follow CUDA's rules on superchip, as FakeTensor predicts; the CPU
# reference's (CPU's rules) are converted before the comparison.
NORM_STATS = {"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update", "native_layer_norm"}


def as_cuda_rules(name: str, expected, sample):
    """``expected`` (the CPU result of op ``name`` on ``sample``) with its saved statistics as
    CUDA's rules give them: [C] in eval mode (the running mean and 1/sqrt(running var + eps)),
    float32 for a bf16/fp16 input."""
    if name not in NORM_STATS or not isinstance(expected, (tuple, list)):
        return expected
    args = (sample.input, *sample.args)
    wide = torch.float32 if args[0].dtype in (torch.bfloat16, torch.float16) else args[0].dtype
    out = list(expected)
    if name != "native_layer_norm" and out[1].numel() == 0 and len(args) >= 8:
        out[1] = args[3].to(wide, copy=True)
        out[2] = torch.rsqrt(args[4].to(wide) + args[7])
    else:
        out[1], out[2] = out[1].to(wide), out[2].to(wide)
    return type(expected)(out)


# Ops with an argument that must stay a CPU tensor, as on CUDA: only their input moves.
CPU_ONLY_ARGS = {
    "tensor_split": "tensor_indices_or_sections must be a CPU tensor (as on CUDA)",
}


def _move_tensor(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` with the same sizes, strides and storage offset: the whole storage
    moves and the view is rebuilt, so ops that read the storage (as_strided) see what they see
    on CPU, and the backend gets the same non-contiguous layouts."""
    if t.layout != torch.strided or t.device.type != "cpu":
        return t.to(device)
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),))
    return flat.to(device).as_strided(t.size(), t.stride(), t.storage_offset())


def _move(obj, device):
    """Recursively moves tensors to ``device`` and rewrites ``device="cpu"`` arguments of
    factory ops (arange, full, ..., ``Tensor.to``) to ``device``."""
    if isinstance(obj, torch.Tensor):
        return _move_tensor(obj, device)
    if isinstance(obj, (str, torch.device)) and str(obj) == "cpu":
        return torch.device(device)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_move(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


def _run(op, sample, device, name):
    if name in CPU_ONLY_ARGS:
        args = (_move(sample.input, device), *sample.args)
    else:
        args = _move((sample.input, *sample.args), device)
    kwargs = _move(dict(sample.kwargs), device)
    torch.manual_seed(1234)
    return op(*args, **kwargs)


def check_op(op) -> tuple[str, str]:
    """Runs one op of op_db; returns (outcome, detail)."""
    name = _op_id(op)
    if name in SKIPS:
        return "skip", SKIPS[name]
    dtype = _sweep_dtype(op)
    if dtype is None:
        return "n/a", "no supported dtype on CPU"
    mark = sweep_mark(op, dtype)
    if mark is not None and mark[0] == "skip":
        return mark
    outcome, detail = _check_samples(op, name, dtype)
    if mark is not None and mark[0] == "xfail":
        if outcome == "fail":
            return "xfail", f"{mark[1]}; {detail}"
        if outcome == "pass":
            return "xpass", f"{mark[1]}, but it matched CPU ({detail})"
    return outcome, detail


def _check_samples(op, name: str, dtype) -> tuple[str, str]:
    try:
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:MAX_SAMPLES]
    except Exception as exc:  # noqa: BLE001  (op_db's own sample generator)
        return "n/a", f"sample_inputs raised {type(exc).__name__}"
    ran = 0
    for i, sample in enumerate(samples):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected = _run(op, sample, "cpu", name)
        except Exception:  # noqa: BLE001  (reference raised: sample not applicable)
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                actual = _run(op, sample, DEVICE, name)
            _compare(actual, as_cuda_rules(name, expected, sample), name in SHAPE_ONLY or op.name in SHAPE_ONLY)
        except Exception as exc:  # noqa: BLE001
            msg = str(exc).strip().splitlines()
            first = msg[0] if msg else ""
            return "fail", f"sample {i} ({dtype}): {type(exc).__name__}: {first[:200]}"
        ran += 1
    if ran == 0:
        return "n/a", "CPU reference raised on every sample"
    return "pass", f"{ran} samples"


SHARDS = 2


def _units(shard: int) -> list:
    """This shard's ops of op_db, round-robin, in a fixed order: [(op id, op_db index)]."""
    return [(_op_id(op), i) for i, op in enumerate(op_db) if i % SHARDS == shard]


def _check_unit(index: int):
    return check_op(op_db[index])


def run_sweep(tmp_path) -> dict[str, tuple[str, str]]:
    """Runs the sweep in worker processes (sweep_runner.py); an op that kills its process is a
    failure ("crash") and its shard goes on from the next op in a fresh process."""
    results = run_shards(__file__, SHARDS, tmp_path, tag="ops",
                         crash_result=lambda msg: ("fail", msg))
    return {name: tuple(res) for name, res in results.items()}


def test_cpu_decorations_carry_over():
    """PyTorch's cpu skips and expected failures apply to superchip: in the sweep, and as
    ``PrivateUse1TestBase.op_overrides`` for PyTorch's own device-generic tests."""
    import copy
    import types
    import unittest

    from torch.testing._internal.common_device_type import PrivateUse1TestBase
    from torch.testing._internal.opinfo.core import DecorateInfo

    from cpu_overrides import cpu_op_overrides

    by_name = {op.full_name: op for op in op_db}
    # grid_sampler_3d is skipped on cpu by every test: the sweep skips it too.
    mark = sweep_mark(by_name["grid_sampler_3d"], torch.float32)
    assert mark is not None and mark[0] == "skip", mark
    # An expected failure on cpu is an expected failure here; one on cuda is not.
    op = copy.deepcopy(by_name["abs"])
    assert sweep_mark(op, torch.float32) is None
    op.decorators = (*op.decorators, DecorateInfo(unittest.expectedFailure, "TestCommon",
                                                  "test_compare_cpu", device_type="cuda"))
    assert sweep_mark(op, torch.float32) is None
    op.decorators = (*op.decorators, DecorateInfo(unittest.expectedFailure, "TestCommon",
                                                  "test_compare_cpu", device_type="cpu",
                                                  dtypes=(torch.float32,)))
    assert sweep_mark(op, torch.float64) is None
    assert sweep_mark(op, torch.float32)[0] == "xfail"
    outcome, detail = check_op(op)  # abs matches CPU: reported, not silent
    assert outcome == "xpass", (outcome, detail)
    # op_overrides: avg_pool3d's cpu expected failure of TestCommon.test_out reaches superchip.
    overrides = cpu_op_overrides()
    assert "nn.functional.avg_pool3d" in overrides
    # and the _refs entries' (test_python_ref*): pdist's cpu expected failure of
    # test_python_ref_torch_fallback (missed before: only op_db was carried over).
    assert any(i.test_name == "test_python_ref_torch_fallback"
               for i in overrides.get("_refs.nn.functional.pdist", ())), overrides.get("_refs.nn.functional.pdist")
    # and the foreach lists' (test_foreach.py): _foreach_pow's cpu "flaky" skip of test_parity.
    assert any(i.test_name == "test_parity" for i in overrides.get("_foreach_pow", ())), overrides.get("_foreach_pow")
    assert all(i.device_type == "privateuse1" for infos in overrides.values() for i in infos)

    if not hasattr(PrivateUse1TestBase, "_apply_op_overrides"):
        return  # torch < 2.13 has no op_overrides mechanism; the sweep's own marks are checked above

    class SuperchipTests(PrivateUse1TestBase):
        op_overrides = {"nn.functional.avg_pool3d": overrides["nn.functional.avg_pool3d"]}

    SuperchipTests.device_type = "privateuse1"
    ops = types.SimpleNamespace(op_list=[by_name["nn.functional.avg_pool3d"]])
    SuperchipTests._apply_op_overrides(ops)
    active = [dec for info in ops.op_list[0].decorators if isinstance(info, DecorateInfo)
              and info.is_active("TestCommon", "test_out", "superchip", torch.float32, {})
              for dec in info.decorators]
    assert unittest.expectedFailure in active


def test_opinfo_sweep_summary(tmp_path):
    results = run_sweep(tmp_path)
    total = len(op_db)
    by_outcome: dict[str, list[str]] = {o: [] for o in ("pass", "xpass", "fail", "xfail",
                                                         "skip", "n/a")}
    for name, (outcome, _) in results.items():
        by_outcome[outcome].append(name)
    passed = len(by_outcome["pass"]) + len(by_outcome["xpass"])
    fraction = passed / total
    applicable = total - len(by_outcome["n/a"])
    print(f"\nOpInfo sweep: {passed} / {total} op_db ops pass ({fraction:.3f}; "
          f"{len(by_outcome['xpass'])} of them expected to fail on cpu); "
          f"{len(by_outcome['fail'])} fail, {len(by_outcome['xfail'])} fail as expected on cpu, "
          f"{len(by_outcome['skip'])} skipped, {len(by_outcome['n/a'])} not applicable; "
          f"pass fraction of applicable ops {passed / max(applicable, 1):.3f}")
    for outcome in ("fail", "xfail", "xpass", "skip", "n/a"):
        for name in sorted(by_outcome[outcome]):
            print(f"  {outcome:4s} {name}: {results[name][1]}")
    assert fraction >= MIN_PASS_FRACTION, (
        f"only {passed}/{total} = {fraction:.3f} of op_db ops pass on superchip "
        f"(need {MIN_PASS_FRACTION}); failures: {sorted(by_outcome['fail'])}")


if __name__ == "__main__":
    worker(_units(int(sys.argv[1])), _check_unit, int(sys.argv[2]), sys.argv[3])
