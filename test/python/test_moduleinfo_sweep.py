"""ModuleInfo sweep: every module of PyTorch's ``module_db`` on superchip against CPU:
forward, backward and memory formats.

For each ``ModuleInfo``, each of its dtypes and each training mode it distinguishes
(``train_and_eval_differ``: train and eval, else train only), the module inputs of
``module_inputs_func(..., device="cpu", requires_grad=True)`` are run as PyTorch's
``TestModule.test_cpu_gpu_parity`` runs them: the module is built on CPU under a fixed seed,
deep-copied to superchip (same parameters and buffers), both get the same inputs (moved with
their strides) and the same seed before the forward (dropout masks, lazy initialisation).

Checks per (module, dtype, mode, input):
- ``forward``: outputs, and the buffers afterwards (running statistics), equal CPU's within
  ``SWEEP_TOLERANCES``;
- ``backward``: ``torch.autograd.grad`` of every differentiable output against the same seeded
  ``grad_outputs``, with respect to the inputs that require grad and the parameters, equals
  CPU's (a ``None`` gradient must be ``None`` on both);
- ``memory_format``: where an input is 4-D/5-D, the forward and backward again
  with channels-last inputs and a contiguous module, contiguous inputs and a channels-last
  module, and both channels-last (``channels_last_3d`` when an input is 5-D), as
  ``TestModule.test_memory_format`` combines them; outputs must also have CPU's strides.

Skips: only ``SKIPS`` below. PyTorch's module decorations do not carry over: its skips of
``test_cpu_gpu_parity`` name CUDA kernels that differ from CPU's (pytorch#98089 GroupNorm,
#115588 KLDivLoss) and those of ``test_memory_format`` PyTorch's own expectations of which
memory format a module returns (losses, Linear, norms: "no channels_last support"); this
sweep checks only that superchip does what CPU does, which holds for all of them.
Every module input runs (no sampling); the cases are split round-robin by module over
``SHARDS`` worker processes (``sweep_runner.py``; a case that kills its worker fails every
check). About 60 s on 2 cores.
``test_moduleinfo_sweep_summary`` prints the counts per check and every failure, and asserts
each check passes at least ``MIN_PASS_FRACTION`` of what it ran.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections import Counter

import torch
from torch.testing._internal.common_modules import module_db

import superchip  # noqa: F401

from helpers import DEVICE
from sweep_runner import run_shards, worker
from test_opinfo_dtypes_sweep import _LCE_AUTO, _flat_tensors, _grad_outputs, _leaves
from test_opinfo_sweep import _compare

SHARDS = 2
MIN_PASS_FRACTION = 0.98
CHECKS = ("forward", "backward", "memory_format")

# (module name, dtype name, check) -> reason: checks not made (test/README.md).
SKIPS: dict[tuple[str, str, str], str] = {
    ("nn.LinearCrossEntropyLoss", "bfloat16", "backward"): _LCE_AUTO,
    ("nn.LinearCrossEntropyLoss", "float16", "backward"): _LCE_AUTO,
}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _modes(info) -> list[bool]:
    return [True, False] if info.train_and_eval_differ else [True]


# ---- one module input on one device ---------------------------------------------------------

def _to_memory_format(obj, fmt):
    """4-D/5-D tensors of ``obj`` in ``fmt`` (channels_last or channels_last_3d by rank),
    still leaves that require grad where the original did."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() in (4, 5):
            f = torch.channels_last if obj.dim() == 4 else torch.channels_last_3d
            return obj.detach().contiguous(memory_format=f).requires_grad_(obj.requires_grad)
        return obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_memory_format(o, fmt) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_memory_format(v, fmt) for k, v in obj.items()}
    return obj


def _run(module, fwd_input, device, training):
    """(outputs, buffers after the forward, gradients or None) of ``module`` at ``device``."""
    inputs: list = []
    args = _leaves(tuple(fwd_input.args), device, inputs)
    kwargs = _leaves(dict(fwd_input.kwargs), device, inputs)
    torch.manual_seed(2024)
    out = module(*args, **kwargs)
    buffers = [b.detach().clone() for b in module.buffers()]
    params = [p for p in module.parameters() if p.requires_grad]
    outs = [t for t in _flat_tensors(out)
            if t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)]
    if not outs or not (inputs or params):
        return out, buffers, None
    grads_out = [g.to(device) for g in _grad_outputs(outs)]
    grads = torch.autograd.grad(outs, inputs + params, grads_out, allow_unused=True)
    return out, buffers, grads


def _compare_grads(actual, expected):
    assert (actual is None) == (expected is None), f"{actual is None=} != {expected is None=}"
    if expected is None:
        return
    assert len(actual) == len(expected), f"{len(actual)} gradients, want {len(expected)}"
    for k, (a, e) in enumerate(zip(actual, expected)):
        assert (a is None) == (e is None), f"grad {k}: {a is None=} != {e is None=}"
        if e is not None:
            _compare(a, e, False)


def _compare_strides(actual, expected):
    for a, e in zip(_flat_tensors(actual), _flat_tensors(expected)):
        if e.layout == torch.strided and e.numel() > 1:
            assert a.stride() == e.stride(), f"strides {a.stride()} != CPU's {e.stride()}"


def _first_line(exc: Exception) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {(msg[0] if msg else '')[:200]}"


def _pair(info, module_input, dtype, training, in_fmt=None, mod_fmt=None):
    """Builds the module on CPU and its superchip copy, runs both; returns (cpu, superchip)
    results of ``_run``, or raises ``_NotApplicable`` when CPU itself raises."""
    c = module_input.constructor_input
    fwd = module_input.forward_input
    if in_fmt is not None:
        fwd = copy.copy(fwd)
        fwd.args = _to_memory_format(fwd.args, in_fmt)
        fwd.kwargs = _to_memory_format(fwd.kwargs, in_fmt)
    try:
        torch.manual_seed(0)
        cpu_module = info.module_cls(*c.args, **c.kwargs).to(dtype)
        cpu_module.train(training)
        sc_module = copy.deepcopy(cpu_module)
        if mod_fmt is not None:
            cpu_module.to(memory_format=mod_fmt)
        expected = _run(cpu_module, fwd, "cpu", training)
    except Exception as exc:  # noqa: BLE001  (reference raised: input not applicable)
        raise _NotApplicable(_first_line(exc)) from exc
    sc_module.to(DEVICE)
    if mod_fmt is not None:
        sc_module.to(memory_format=mod_fmt)
    return expected, _run(sc_module, fwd, DEVICE, training)


class _NotApplicable(Exception):
    pass


def _rank(tensors) -> int:
    """5 when one of ``tensors`` is 5-D, 4 when one is 4-D, else 0."""
    dims = {t.dim() for t in tensors
            if not isinstance(t, torch.nn.parameter.UninitializedTensorMixin)}
    return 5 if 5 in dims else 4 if 4 in dims else 0


def _memformat_combos(info, module_input, dtype):
    """(input format, module format) pairs for ``module_input``: channels-last inputs with a
    contiguous module, and where the module has 4-D/5-D parameters (materialised: a lazy
    module has none before its first forward), a channels-last module with contiguous and
    with channels-last inputs."""
    fwd = module_input.forward_input
    in_rank = _rank(_flat_tensors((fwd.args, fwd.kwargs)))
    c = module_input.constructor_input
    try:
        params = list(info.module_cls(*c.args, **c.kwargs).to(dtype).parameters())
    except Exception:  # noqa: BLE001  (the plain check reports construction failures)
        params = []
    mod_rank = _rank(params)
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}
    combos = []
    if in_rank:
        combos.append((fmt[in_rank], None))
    if mod_rank:
        combos.append((None, fmt[mod_rank]))
        if in_rank:
            combos.append((fmt[in_rank], fmt[mod_rank]))
    return combos


# ---- one (module, dtype, mode) --------------------------------------------------------------

def check_case(info, dtype, training) -> dict[str, tuple[str, str]]:
    """{check: (outcome, detail)} over every module input of (info, dtype, training)."""
    res = {check: ("skip", SKIPS[(info.name, _dtype_name(dtype), check)]) for check in CHECKS
           if (info.name, _dtype_name(dtype), check) in SKIPS}
    todo = [check for check in CHECKS if check not in res]
    if not todo:
        return res
    try:
        module_inputs = info.module_inputs_func(info, device="cpu", dtype=dtype,
                                                requires_grad=True, training=training)
    except Exception as exc:  # noqa: BLE001  (module_db's own input generator)
        return {**res, **{c: ("n/a", f"module_inputs_func raised {_first_line(exc)}")
                          for c in todo}}
    ran = Counter()
    fails: dict[str, str] = {}
    for i, module_input in enumerate(module_inputs):
        if module_input.forward_input is None:
            continue
        where = f"input {i} {module_input.desc!r}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if "forward" in todo or "backward" in todo:
                _check_plain(info, module_input, dtype, training, todo, where, ran, fails)
            if "memory_format" in todo:
                _check_memformat(info, module_input, dtype, training, where, ran, fails)
    for check in todo:
        if check in fails:
            res[check] = ("fail", fails[check])
        elif ran[check]:
            res[check] = ("pass", f"{ran[check]} inputs")
        else:
            res[check] = ("n/a", {"forward": "CPU reference raised on every input",
                                  "backward": "no input with a differentiable output",
                                  "memory_format": "no 4-D/5-D input or parameter"}[check])
    return res


def _check_plain(info, module_input, dtype, training, todo, where, ran, fails):
    try:
        (e_out, e_buf, e_grads), (a_out, a_buf, a_grads) = _pair(
            info, module_input, dtype, training)
    except _NotApplicable:
        return
    except Exception as exc:  # noqa: BLE001
        for check in ("forward", "backward"):
            fails.setdefault(check, f"{where}: {_first_line(exc)}")
        return
    try:
        _compare(a_out, e_out, False)
        _compare(a_buf, e_buf, False)
        ran["forward"] += 1
    except Exception as exc:  # noqa: BLE001
        fails.setdefault("forward", f"{where}: {_first_line(exc)}")
    if "backward" in todo and e_grads is not None:
        try:
            _compare_grads(a_grads, e_grads)
            ran["backward"] += 1
        except Exception as exc:  # noqa: BLE001
            fails.setdefault("backward", f"{where}: {_first_line(exc)}")


def _check_memformat(info, module_input, dtype, training, where, ran, fails):
    ok = False
    for in_fmt, mod_fmt in _memformat_combos(info, module_input, dtype):
        label = f"{where} input {in_fmt or 'contiguous'}, module {mod_fmt or 'contiguous'}"
        try:
            (e_out, e_buf, e_grads), (a_out, a_buf, a_grads) = _pair(
                info, module_input, dtype, training, in_fmt, mod_fmt)
        except _NotApplicable:
            continue
        except Exception as exc:  # noqa: BLE001
            fails.setdefault("memory_format", f"{label}: {_first_line(exc)}")
            return
        try:
            _compare(a_out, e_out, False)
            _compare_strides(a_out, e_out)
            _compare(a_buf, e_buf, False)
            _compare_grads(a_grads, e_grads)
            ok = True
        except Exception as exc:  # noqa: BLE001
            fails.setdefault("memory_format", f"{label}: {_first_line(exc)}")
            return
    if ok:
        ran["memory_format"] += 1


# ---- worker processes -----------------------------------------------------------------------

def _units(shard: int) -> list[tuple[str, tuple[int, str, bool]]]:
    """The shard's (module, dtype, mode) cases: modules round-robin over the shards."""
    return [(f"{info.name}@{_dtype_name(dtype)}@{'train' if training else 'eval'}",
             (i, _dtype_name(dtype), training))
            for i, info in enumerate(module_db) if i % SHARDS == shard
            for dtype in sorted(info.dtypes, key=str) for training in _modes(info)]


def _check_unit(arg) -> dict:
    index, dtype, training = arg
    return check_case(module_db[index], getattr(torch, dtype), training)


def test_moduleinfo_sweep_summary(tmp_path):
    results = run_shards(__file__, SHARDS, tmp_path, tag="modules",
                         crash_result=lambda msg: {c: ("fail", msg) for c in CHECKS})
    assert len(results) == sum(len(_units(s)) for s in range(SHARDS))
    rates = {}
    for check in CHECKS:
        by_outcome: dict[str, list[str]] = {o: [] for o in ("pass", "fail", "skip", "n/a")}
        for uid, res in results.items():
            if check in res:
                by_outcome[res[check][0]].append(uid)
        passed, failed = len(by_outcome["pass"]), len(by_outcome["fail"])
        rates[check] = (passed, passed + failed)
        inputs = sum(int(results[uid][check][1].split()[0]) for uid in by_outcome["pass"])
        print(f"\nModuleInfo sweep, {check}: {passed} / {passed + failed} (module, dtype, mode)"
              f" cases run pass ({passed / max(passed + failed, 1):.4f}; {inputs} module inputs"
              f" in the passing cases); {failed} fail, "
              f"{len(by_outcome['skip'])} skipped, {len(by_outcome['n/a'])} not applicable, "
              f"{len(results)} cases of {len(module_db)} modules")
        for outcome in ("fail", "skip"):
            for uid in sorted(by_outcome[outcome]):
                print(f"  {outcome:5s} {uid}: {results[uid][check][1]}")
    for check, (passed, ran) in rates.items():
        assert passed / max(ran, 1) >= MIN_PASS_FRACTION, (
            f"{check}: only {passed}/{ran} module cases pass on superchip "
            f"(need {MIN_PASS_FRACTION})")


if __name__ == "__main__":
    worker(_units(int(sys.argv[1])), _check_unit, int(sys.argv[2]), sys.argv[3])
