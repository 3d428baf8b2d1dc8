"""PyTorch's CPU test decorations, carried over to superchip (its executor runs CPU kernels).

OpInfo entries mark known failures per device (``DecorateInfo(unittest.expectedFailure,
"TestCommon", "test_out", device_type="cpu")``, skips, tolerance overrides). With the CPU
executor a superchip op *is* the CPU kernel over the same bytes, so a CPU-only failure is
expected on superchip too.

- ``cpu_op_overrides()`` gives them in the form of torch 2.13's
  ``PrivateUse1TestBase.op_overrides`` ({OpInfo.full_name: [DecorateInfo]}), for running
  PyTorch's own device-generic tests on superchip::

      PrivateUse1TestBase.set_test_configs(op_overrides=cpu_op_overrides())

  (``_apply_op_overrides`` re-targets each DecorateInfo to the superchip device type).
- ``sweep_mark(op, dtype)`` tells the OpInfo sweep whether one of them applies to what it
  runs (``TEST`` below) at ``dtype``: ``("skip", reason)``, ``("xfail", reason)`` or None.
"""

from __future__ import annotations

import copy
import unittest

from torch.testing._internal.common_methods_invocations import (
    foreach_binary_op_db,
    foreach_other_op_db,
    foreach_pointwise_op_db,
    foreach_reduce_op_db,
    foreach_unary_op_db,
    op_db,
    python_ref_db,
)
from torch.testing._internal.opinfo.core import DecorateInfo

# The PyTorch test whose check the OpInfo sweep performs: the op on the device against the
# same op on CPU, sample by sample.
TEST = ("TestCommon", "test_compare_cpu")
SUPERCHIP = "superchip"


def _is_cpu(info: DecorateInfo) -> bool:
    d = info.device_type
    return d == "cpu" or (isinstance(d, (list, tuple)) and "cpu" in d)


def cpu_op_overrides(ops=None) -> dict[str, list[DecorateInfo]]:
    """Every DecorateInfo that PyTorch attaches to an op for device_type 'cpu' (expected
    failures, skips, tolerance overrides), copied and re-targeted to PrivateUse1. By default
    from op_db, python_ref_db (the ``_refs.*`` entries test_ops.py's ``test_python_ref*``
    tests run) and the ``_foreach_*`` lists test_foreach.py runs (a cpu "flaky" skip of
    _foreach_pow's complex64 parity was missed: found running test_foreach.py on superchip);
    their names never collide."""
    overrides: dict[str, list[DecorateInfo]] = {}
    default = (*op_db, *python_ref_db, *foreach_unary_op_db, *foreach_binary_op_db,
               *foreach_pointwise_op_db, *foreach_reduce_op_db, *foreach_other_op_db)
    for op in default if ops is None else ops:
        for info in op.decorators:
            if isinstance(info, DecorateInfo) and _is_cpu(info):
                carried = copy.copy(info)
                carried.decorators = list(info.decorators)
                carried.device_type = "privateuse1"
                overrides.setdefault(op.full_name, []).append(carried)
    return overrides


def _skip_reason(decorator) -> str | None:
    """The reason of a ``unittest.skip(reason)`` decorator, None for other decorators."""
    if getattr(decorator, "__qualname__", "").startswith("skip.") and decorator.__closure__:
        for cell in decorator.__closure__:
            if isinstance(cell.cell_contents, str):
                return cell.cell_contents
        return "skipped"
    return None


def sweep_mark(op, dtype, test=TEST) -> tuple[str, str] | None:
    """("skip" | "xfail", reason) when a carried-over CPU decoration applies to ``test`` of
    ``op`` at ``dtype`` on superchip; None otherwise."""
    mark = None
    for info in cpu_op_overrides([op]).get(op.full_name, []):
        info.device_type = SUPERCHIP  # what _apply_op_overrides does for PrivateUse1
        if not info.is_active(test[0], test[1], SUPERCHIP, dtype, {}):
            continue
        where = f"{info.cls_name or '*'}.{info.test_name or '*'}"
        for decorator in info.decorators:
            reason = _skip_reason(decorator)
            if reason is not None:
                return "skip", f"PyTorch skips it on cpu ({where}): {reason}"
            if decorator is unittest.expectedFailure:
                mark = ("xfail", f"PyTorch expects it to fail on cpu ({where})")
    return mark
